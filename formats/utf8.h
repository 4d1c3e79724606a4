/* utf8.h — UTF-8 as Hugging Face reads bytes that are not valid UTF-8: Python's
 * bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy replace each maximal
 * ill-formed subsequence with U+FFFD (Unicode 15, section 3.9, "U+FFFD Substitution of Maximal
 * Subparts"). The tokenizer converts its text this way, and the JSON Lines reader its records
 * before parsing them, so both read the same bytes as the same text.
 */
#ifndef TKD_UTF8_H
#define TKD_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* The length of the well-formed sequence at s[0, n) (n >= 1; Unicode table 3-7), or -(length of
 * its maximal ill-formed prefix, at least 1): what one U+FFFD replaces. */
long tkd_utf8_seq(const uint8_t *s, size_t n);

/* The length of the longest prefix of s[0, n) that is valid UTF-8 (n when all of it is). */
size_t tkd_utf8_valid_prefix(const uint8_t *s, size_t n);

/* s[0, n) with each maximal ill-formed subsequence replaced by U+FFFD (EF BF BD), written to out,
 * which holds at least 3n bytes (one U+FFFD per byte at most). Returns the bytes written. */
size_t tkd_utf8_lossy(const uint8_t *s, size_t n, uint8_t *out);

#endif /* TKD_UTF8_H */
