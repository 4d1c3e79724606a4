/* fuzz_safetensors.c — libFuzzer target for the safetensors header parser and the fp32 reader.
 * Built and run by scripts/fuzz.sh (seeds: tests/fuzz/corpus/*.safetensors and the st_* broken
 * files).
 *
 * The property: any input either opens (and then every float tensor converts without reading
 * outside the buffer) or is refused with TKD_ERR_FORMAT and a message; nothing crashes or leaks.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "formats/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tkd_st_dir *d = NULL;
    tkd_status st = tkd_st_open_memory("fuzz.safetensors", data, size, &d);
    if (st != TKD_OK) {
        if (st != TKD_ERR_FORMAT && st != TKD_ERR_NOMEM)
            abort(); /* a malformed image must be a format error */
        if (tkd_error_msg()[0] == '\0')
            abort(); /* and say why */
        return 0;
    }
    for (int i = 0; i < tkd_st_count(d); i++) {
        const tkd_st_tensor *t = tkd_st_at(d, i);
        size_t n = t->nbytes / tkd_dtype_size(t->dtype);
        if (t->dtype > TKD_DTYPE_BF16 || n > (1u << 20))
            continue;
        float *dst = malloc(n ? n * sizeof *dst : 1);
        if (!dst)
            break;
        if (tkd_st_read_f32(d, t->name, t->ndim, t->shape, dst, n) != TKD_OK)
            abort(); /* a tensor that validated must convert */
        free(dst);
    }
    tkd_st_close(d);
    return 0;
}
