/* utf8.c — see utf8.h. */
#include "formats/utf8.h"

#include <string.h>

long tkd_utf8_seq(const uint8_t *s, size_t n)
{
    uint8_t b = s[0];
    if (b < 0x80)
        return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF)
        need = 1;
    else if (b >= 0xE0 && b <= 0xEF)
        need = 2, lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
    else if (b >= 0xF0 && b <= 0xF4)
        need = 3, lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
    else
        return -1;
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n || s[i] < lo || s[i] > hi)
            return -i;
        lo = 0x80, hi = 0xBF; /* only the second byte has a narrower range */
    }
    return need + 1;
}

size_t tkd_utf8_valid_prefix(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) { /* ASCII, most text: no call */
            i++;
            continue;
        }
        long l = tkd_utf8_seq(s + i, n - i);
        if (l < 0)
            break;
        i += (size_t)l;
    }
    return i;
}

size_t tkd_utf8_lossy(const uint8_t *s, size_t n, uint8_t *out)
{
    size_t i = tkd_utf8_valid_prefix(s, n), o = i;
    memcpy(out, s, i);
    while (i < n) {
        long l = tkd_utf8_seq(s + i, n - i);
        if (l > 0) {
            memcpy(out + o, s + i, (size_t)l);
            o += (size_t)l, i += (size_t)l;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3, i += (size_t)-l;
        }
    }
    return o;
}
