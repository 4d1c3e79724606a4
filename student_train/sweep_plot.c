/* sweep_plot.c — see sweep_plot.h. */
#include "student_train/sweep_plot.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define W 760        /* the whole picture, px */
#define H 440
#define LEFT 70      /* the plot area's margins: tick labels left and below, the legend right */
#define RIGHT 210
#define TOP 40
#define BOTTOM 60
#define MAX_TICKS 7

/* Colours that stay apart for up to ten series (matplotlib's tab10); more series repeat them. */
static const char *const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

int tkd_plot_ticks(double lo, double hi, int max_ticks, double *ticks, int cap, double *step)
{
    double range = hi > lo ? hi - lo : 1.0;
    double p = pow(10.0, floor(log10(range / max_ticks)));
    static const double mult[] = {1, 2, 5, 10};
    double s = p * 10;
    for (int i = 0; i < 4; i++)
        if (range / (p * mult[i]) <= max_ticks) {
            s = p * mult[i];
            break;
        }
    int n = 0;
    double k0 = ceil(lo / s - 1e-9); /* each tick a multiple of s, not a sum of them (no drift) */
    for (double t = k0 * s; t <= hi + s * 1e-9 && n < cap; t = (k0 + n) * s)
        ticks[n++] = t == 0 ? 0.0 : t; /* -0 prints as "-0" */
    *step = s;
    return n;
}

/* Text for an SVG element: &, <, > and " escaped. */
static void put_escaped(FILE *f, const char *t)
{
    for (; *t; t++) {
        if (*t == '&') fputs("&amp;", f);
        else if (*t == '<') fputs("&lt;", f);
        else if (*t == '>') fputs("&gt;", f);
        else if (*t == '"') fputs("&quot;", f);
        else fputc(*t, f);
    }
}

typedef struct bounds {
    double x0, x1, y0, y1;
} bounds;

/* The data's extent (finite points only), widened where it is a single value. */
static bounds data_bounds(const tkd_plot_series *s, int ns)
{
    bounds b = {INFINITY, -INFINITY, INFINITY, -INFINITY};
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < s[i].n; j++) {
            if (!isfinite(s[i].y[j]) || !isfinite(s[i].x[j]))
                continue;
            b.x0 = fmin(b.x0, s[i].x[j]), b.x1 = fmax(b.x1, s[i].x[j]);
            b.y0 = fmin(b.y0, s[i].y[j]), b.y1 = fmax(b.y1, s[i].y[j]);
        }
    if (!(b.x0 <= b.x1)) /* no point at all */
        b = (bounds){0, 1, 0, 1};
    if (b.x1 - b.x0 <= 0)
        b.x1 = b.x0 + 1;
    double pad = b.y1 > b.y0 ? 0.05 * (b.y1 - b.y0) : 0.5;
    b.y0 -= pad, b.y1 += pad;
    return b;
}

static double px(const bounds *b, double x) { return LEFT + (x - b->x0) / (b->x1 - b->x0) * (W - LEFT - RIGHT); }
static double py(const bounds *b, double y) { return H - BOTTOM - (y - b->y0) / (b->y1 - b->y0) * (H - TOP - BOTTOM); }

/* The frame, the grid lines and tick labels of both axes, and the axis titles. */
static void put_axes(FILE *f, const bounds *b, const char *xlabel, const char *ylabel)
{
    double t[16], step;
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#333\"/>\n", LEFT, TOP,
            W - LEFT - RIGHT, H - TOP - BOTTOM);
    int n = tkd_plot_ticks(b->x0, b->x1, MAX_TICKS, t, 16, &step);
    for (int i = 0; i < n; i++)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#ddd\"/>"
                "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g</text>\n",
                px(b, t[i]), TOP, px(b, t[i]), H - BOTTOM, px(b, t[i]), H - BOTTOM + 18, t[i]);
    n = tkd_plot_ticks(b->y0, b->y1, MAX_TICKS, t, 16, &step);
    for (int i = 0; i < n; i++)
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                LEFT, py(b, t[i]), W - RIGHT, py(b, t[i]), LEFT - 6, py(b, t[i]) + 4, t[i]);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">", (LEFT + W - RIGHT) / 2, H - 15);
    put_escaped(f, xlabel);
    fprintf(f, "</text>\n<text transform=\"translate(18,%d) rotate(-90)\" text-anchor=\"middle\">", (TOP + H - BOTTOM) / 2);
    put_escaped(f, ylabel);
    fputs("</text>\n", f);
}

/* One polyline per series (NaN points skipped), and its legend entry. */
static void put_series(FILE *f, const bounds *b, const tkd_plot_series *s, int i)
{
    const char *c = palette[i % (int)(sizeof palette / sizeof palette[0])];
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", c);
    for (int j = 0, first = 1; j < s->n; j++)
        if (isfinite(s->y[j])) {
            fprintf(f, "%s%.1f,%.1f", first ? "" : " ", px(b, s->x[j]), py(b, s->y[j]));
            first = 0;
        }
    int ly = TOP + 10 + 20 * i;
    fprintf(f, "\"/>\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"3\"/>"
            "<text x=\"%d\" y=\"%d\">", W - RIGHT + 15, ly, W - RIGHT + 40, ly, c, W - RIGHT + 46, ly + 4);
    put_escaped(f, s->name);
    fputs("</text>\n", f);
}

tkd_status tkd_plot_svg(const char *head, const char *title, const char *xlabel, const char *ylabel,
                        const tkd_plot_series *s, int ns, char **out)
{
    size_t len = 0;
    *out = NULL;
    FILE *f = open_memstream(out, &len);
    if (!f)
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the plot");
    bounds b = data_bounds(s, ns);
    fprintf(f, "%s<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
            "<text x=\"%d\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">", head ? head : "", W, H, W, H,
            (LEFT + W - RIGHT) / 2);
    put_escaped(f, title);
    fputs("</text>\n", f);
    put_axes(f, &b, xlabel, ylabel);
    for (int i = 0; i < ns; i++)
        put_series(f, &b, &s[i], i);
    fputs("</svg>\n", f);
    if (fclose(f) != 0 || !*out) {
        free(*out);
        *out = NULL;
        return tkd_error_set(TKD_ERR_NOMEM, "out of memory for the plot");
    }
    return TKD_OK;
}
