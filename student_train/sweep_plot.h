/* sweep_plot.h — a small SVG line plot, written by hand (no plotting library): axes with "nice"
 * ticks, one polyline per series, a legend. student-train sweep draws its validation curves with it;
 * a browser shows the file. */
#ifndef TKD_SWEEP_PLOT_H
#define TKD_SWEEP_PLOT_H

#include "common/status.h"

typedef struct tkd_plot_series {
    const char *name;  /* the legend's text (escaped for XML here) */
    const double *x;   // (n,) increasing
    const double *y;   // (n,) NaN points are skipped
    int n;
} tkd_plot_series;

/* The plot as an SVG document in *out (malloc'd, the caller frees it). It begins with head (an XML
 * comment the caller uses to recognise its own file; may be NULL). A series without points is only
 * in the legend. */
tkd_status tkd_plot_svg(const char *head, const char *title, const char *xlabel, const char *ylabel,
                        const tkd_plot_series *s, int ns, char **out);

/* Tick positions for [lo, hi]: a step of 1, 2 or 5 times a power of ten giving at most max_ticks
 * ticks, the first the smallest multiple of it >= lo. Returns the count (<= cap) and the step. */
int tkd_plot_ticks(double lo, double hi, int max_ticks, double *ticks, int cap, double *step);

#endif /* TKD_SWEEP_PLOT_H */
