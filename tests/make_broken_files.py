#!/usr/bin/env python3
"""Writes tests/data/broken/: tiny malformed safetensors, token (llm.c, .npy, Megatron-LM pairs: the row
names the .idx, its .bin lies beside it), config.json, cache manifest and YAML config files, one
defect each (and a small valid seed for the fuzz target, tests/fuzz/corpus/).

tests/data/broken/EXPECTED.tsv lists <file> <TAB> <status name> <TAB> <substring the error message
must contain>; test_safetensors.c reads the st_* rows, test_tokens.c the tok_* rows,
test_hf_config.c the hf_* rows, test_cache_broken.c the man_* rows and test_config.c the cfg_* rows.
Run it again after changing a case: python3 tests/make_broken_files.py (stdlib only).
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "broken")

rows = []


def put(name, data, status, substring):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
    rows.append((name, status, substring))


def st(header, data=b"", hlen=None):
    """A safetensors image: header given as a dict (dumped) or raw bytes."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


F = "TKD_ERR_FORMAT"
ok1 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def safetensors_cases():
    put("st_short.safetensors", b"\x10\x00\x00", F, "shorter than the 8-byte header length")
    put("st_empty.safetensors", b"", F, "shorter than the 8-byte header length")
    put("st_hlen_small.safetensors", st(b"{", hlen=1), F, "header length 1 is too small")
    put("st_hlen_huge.safetensors", st(b"{}", hlen=1 << 40), F, "larger than the 100 MB limit")
    put("st_hlen_past_eof.safetensors", st(b'{"a":1}', hlen=4096), F, "exceeds the file")
    put("st_bad_json.safetensors", st(b'{"w": {"dtype": "F32",'), F, "not valid JSON")
    put("st_not_object.safetensors", st(b"[1, 2, 3]"), F, "not an object")
    put("st_entry_not_object.safetensors", st({"w": 3}), F, "tensor 'w': header entry is not a JSON object")
    put("st_no_dtype.safetensors", st({"w": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), F,
        "tensor 'w': missing or non-string \"dtype\"")
    put("st_dtype_f64.safetensors", st({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
        F, "tensor 'w': dtype F64 is not supported")
    put("st_shape_negative.safetensors", st({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                                            b"\0" * 8), F, "tensor 'w': shape[0] is not a non-negative integer")
    put("st_shape_fraction.safetensors", st({"w": {"dtype": "F32", "shape": [2, 0.5], "data_offsets": [0, 4]}},
                                            b"\0" * 4), F, "shape[1] is not a non-negative integer")
    put("st_shape_9d.safetensors", st({"w": {"dtype": "U8", "shape": [1] * 9, "data_offsets": [0, 1]}}, b"\0"),
        F, "shape has 9 dimensions")
    put("st_offsets_one.safetensors", st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8),
        F, "must be an array [begin, end]")
    put("st_offsets_negative.safetensors", st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
                                              b"\0" * 8), F, "data_offsets are not non-negative integers")
    put("st_begin_gt_end.safetensors", st({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
                                          b"\0" * 8), F, "have begin > end")
    put("st_truncated_data.safetensors", st({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                                            b"\0" * 10), F, "end past the data region (10 bytes)")
    put("st_size_mismatch.safetensors", st({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}},
                                           b"\0" * 8), F, "tensor 'w': BF16 x shape [3] needs 6 bytes")
    put("st_overlap.safetensors", st({"a": ok1, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                                     b"\0" * 12), F, "tensors 'a' (bytes 0..8) and 'b' (bytes 4..12) overlap")
    put("st_duplicate.safetensors", st(b'{"w": %s, "w": %s}' % (json.dumps(ok1).encode(), json.dumps(
        {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}).encode()), b"\0" * 16), F,
        'duplicate key "w"')
    # the first "dtype" used to win silently
    put("st_dup_dtype.safetensors", st(b'{"w": {"dtype": "F32", "dtype": "BF16", "shape": [2], '
                                       b'"data_offsets": [0, 8]}}', b"\0" * 8), F,
        'duplicate key "dtype" (first at line 1, column 8)')
    put("st_bad_metadata.safetensors", st({"__metadata__": "pt", "w": ok1}, b"\0" * 8), F,
        "\"__metadata__\" is not a JSON object")


def tok_bin(magic, version, count, payload, header_len=256):
    h = [0] * header_len
    h[0], h[1], h[2] = magic, version, count
    return struct.pack("<%di" % header_len, *h) + payload


def npy(header_dict_text, payload, major=1):
    """An .npy image with a hand-written header dict (no numpy here)."""
    magic = b"\x93NUMPY" + bytes([major, 0])
    lenfmt, lensize = ("<H", 2) if major == 1 else ("<I", 4)
    h = header_dict_text.encode("latin1")
    pad = (-(len(magic) + lensize + len(h) + 1)) % 64
    h = h + b" " * pad + b"\n"
    return magic + struct.pack(lenfmt, len(h)) + h + payload


def token_cases():
    u16 = struct.pack("<4H", 1, 2, 3, 4)
    put("tok_bad_magic.bin", tok_bin(12345, 1, 4, u16), F, "bad magic 12345")
    put("tok_bad_version.bin", tok_bin(20240520, 7, 4, u16), F, "version 7")
    put("tok_short_header.bin", tok_bin(20240520, 1, 4, b"", header_len=100), F, "shorter than the 1024-byte")
    put("tok_truncated.bin", tok_bin(20240520, 1, 10, u16), F, "truncated: the header promises 10 tokens")
    put("tok_count_mismatch.bin", tok_bin(20240801, 2, 2, struct.pack("<4I", 1, 2, 3, 4)), F,
        "token count mismatch: the header says 2 tokens")
    put("tok_f4.npy", npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 8),
        "TKD_ERR_UNSUPPORTED", "dtype '<f4' is not supported")
    put("tok_bigendian.npy", npy("{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }", b"\0" * 8),
        "TKD_ERR_UNSUPPORTED", "dtype '>i4' is not supported")
    put("tok_fortran.npy", npy("{'descr': '<i4', 'fortran_order': True, 'shape': (2, 2), }", b"\0" * 16),
        "TKD_ERR_UNSUPPORTED", "Fortran order")
    put("tok_3d.npy", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (1, 2, 2), }", b"\0" * 16),
        "TKD_ERR_UNSUPPORTED", "3 dimensions")
    put("tok_npy_truncated.npy", npy("{'descr': '<u2', 'fortran_order': False, 'shape': (8,), }", b"\0" * 6),
        F, "truncated: the header promises 8 tokens")
    put("tok_npy_bad_header.npy", npy("{'descr': '<i4', 'shape': (2,), }", b"\0" * 8), F,
        "no 'fortran_order'")
    put("tok_npy_cut_header.npy", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", b"")[:20], F,
        "header runs past the end of the file")
    # the first 'shape' used to win silently (the payload fits it)
    put("tok_npy_dup_shape.npy", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'shape': (3,), }",
                                     b"\0" * 8), F, "npy header has the key 'shape' twice")
    put("tok_npy_extra_key.npy", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'order': 'C', }",
                                     b"\0" * 8), F, "npy header has the key 'order'; numpy writes only")
    put("tok_npy_not_dict.npy", npy("{'descr': '<i4', 'fortran_order': False 'shape': (2,)}", b"\0" * 8), F,
        "npy header is not a Python dict: expected ',' or '}' after a value")
    put("tok_npy_fortran_word.npy", npy("{'descr': '<i4', 'fortran_order': Falsey, 'shape': (2,), }", b"\0" * 8),
        F, "'fortran_order' is neither True nor False")
    # no tokens at all (reading them did pointer arithmetic on a NULL buffer: UBSan, found by fuzz_tokens)
    put("tok_npy_empty.npy", npy("{'descr': '<u4', 'fortran_order': False, 'shape': (0,), }", b""), F,
        "the dataset holds no tokens")
    put("tok_npy_big_u4.npy", npy("{'descr': '<u4', 'fortran_order': False, 'shape': (3,), }",
                                  struct.pack("<3I", 5, 0x80000000, 7)), F,
        "token 2147483648 at token offset 1 does not fit in int32")


HF_OK = """{
  "model_type": "llama",
  "vocab_size": 128,
  "hidden_size": 16,
  "intermediate_size": 32,
  "num_hidden_layers": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
}
"""


def hf_config_cases():
    # each of these used to load with the first value
    put("hf_dup_vocab.json", HF_OK.replace('  "hidden_size"', '  "vocab_size": 256,\n  "hidden_size"').encode(),
        F, 'hf_dup_vocab.json:4:3: duplicate key "vocab_size" (first at line 3, column 3)')
    # inf in a field (1e999), or a float field past FLT_MAX, was read and then written back as "inf"
    # (found by fuzz_hf_config)
    put("hf_inf.json", HF_OK.replace('"factor": 8.0', '"factor": 1e999').encode(), F,
        'field "rope_scaling.factor" must be a finite number')
    put("hf_float_overflow.json", HF_OK.replace('  "hidden_size"', '  "initializer_range": 1e93,\n  "hidden_size"')
        .encode(), F, 'field "initializer_range" = 1e+93 does not fit a float')
    put("hf_dup_nested.json", HF_OK.replace('"factor": 8.0,', '"factor": 8.0, "factor": 2.0,').encode(), F,
        'duplicate key "factor" (first at line 9')


MANIFEST_OK = """format: topkd-cache
version: 1
teacher:
  path: teacher
  architecture: llama
  vocab_size: 1000
  sha256: "%s"
dataset:
  path: tokens.bin
  sha256: "%s"
  tokens: 100
  seq_len: 8
  stride: 8
k: 4
tail_samples: 0
logits_dtype: half
temperature: 1
shards:
  - file: shard-00000.h5
    first_seq: 0
    num_seq: 2
    bytes: 100
    sha256: "%s"
""" % ("a" * 64, "b" * 64, "c" * 64)


def manifest_cases():
    # the first k / num_seq used to win silently
    put("man_dup_k.yaml", (MANIFEST_OK + "k: 5\n").encode(), F,
        "man_dup_k.yaml:24:1: duplicate key 'k' (first at line 14)")
    put("man_dup_shard_key.yaml", MANIFEST_OK.replace("    num_seq: 2\n", "    num_seq: 2\n    num_seq: 3\n").encode(),
        F, "man_dup_shard_key.yaml:22:5: duplicate key 'num_seq' (first at line 21)")
    # first_seq + num_seq past 2^63 (the end of the shard overflowed)
    put("man_seq_overflow.yaml", MANIFEST_OK.replace("    first_seq: 0\n", "    first_seq: 9223372036854775807\n")
        .encode(), F, "man_seq_overflow.yaml:19:5: manifest: shard shard-00000.h5: first_seq 9223372036854775807 + "
        "num_seq 2 is past 2^63")
    # libyaml's scanner is quadratic in nesting depth; 1000 levels is enough to show the bound
    put("man_deep.yaml", (MANIFEST_OK + "extra: " + "[" * 1000 + "]" * 1000 + "\n").encode(), F,
        "man_deep.yaml:24:71: YAML nested deeper than 64 levels")


def yaml_config_cases():
    """For the test schema of tests/test_config.c (seed, kd.*, train.*)."""
    c = "TKD_ERR_CONFIG"
    put("cfg_dup_key.yaml", b"kd:\n  alpha: 0.5\n  top_k: 8\n  alpha: 0.7\n", c,
        "cfg_dup_key.yaml:4:3: duplicate key 'kd.alpha' (first at line 2)")
    put("cfg_deep.yaml", b"train:\n  files: " + b"[" * 1000 + b"]" * 1000 + b"\n", c,
        "cfg_deep.yaml:2:72: YAML nested deeper than 64 levels")


def llmc_cases():
    """llm.c headers: the eval-file magic, a version that does not go with its magic, a uint32 token
    past int32."""
    u32 = struct.pack("<4I", 128000, 1, 2, 3)
    put("tok_llmc_eval.bin", tok_bin(20240522, 1, 4, u32), F, "magic 20240522 marks an llm.c eval file")
    put("tok_v1_u32.bin", tok_bin(20240801, 1, 4, u32), F,
        "version 1 does not go with magic 20240801 (expected 7, or topkd's former 2)")
    put("tok_llama3_big.bin", tok_bin(20240801, 7, 3, struct.pack("<3I", 128000, 0x80000000, 7)), F,
        "token 2147483648 at token offset 1 does not fit in int32")


MM_SIZES = [3, 2, 4, 0, 1]  # five sequences, ten tokens
MM_DOCS = [0, 2, 2, 4, 5]   # four documents (the second one empty)


def mm_idx(code=8, sizes=MM_SIZES, docs=MM_DOCS, pointers=None, version=1, magic=b"MMIDIDX\x00\x00",
           nseq=None, ndoc=None, tail=b""):
    """A Megatron-LM .idx: magic, uint64 version, uint8 dtype code, uint64 sequence_count, uint64
    document_count, int32 sizes, int64 pointers (back to back unless given), int64 document indices."""
    tsz = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}.get(code, 2)
    if pointers is None:
        pointers = [sum(sizes[:i]) * tsz for i in range(len(sizes))]
    return (magic + struct.pack("<QBQQ", version, code, len(sizes) if nseq is None else nseq,
                                len(docs) if ndoc is None else ndoc)
            + struct.pack("<%di" % len(sizes), *sizes) + struct.pack("<%dq" % len(pointers), *pointers)
            + struct.pack("<%dq" % len(docs), *docs) + tail)


def mm(name, idx, status, substring, nbin=20):
    """tok_mm_<name>.idx (the row) with a .bin of nbin bytes beside it (none when nbin is None)."""
    if nbin is not None:
        with open(os.path.join(OUT, "tok_mm_%s.bin" % name), "wb") as f:
            f.write(bytes(range(nbin)))
    put("tok_mm_%s.idx" % name, idx, status, substring)


def megatron_cases():
    """Megatron-LM indexed datasets, one defect each (the .bin holds 10 uint16 tokens = 20 bytes)."""
    mm("short", mm_idx()[:20], F, "20 bytes, shorter than the 34-byte MMIDIDX header")
    mm("bad_magic", mm_idx(magic=b"MMIDIDY\x00\x00"), F, "bad magic (expected \"MMIDIDX\\x00\\x00\")")
    mm("version", mm_idx(version=2), F, "index version 2 is not supported (expected 1)")
    mm("dtype_float", mm_idx(code=7), "TKD_ERR_UNSUPPORTED", "dtype code 7 (float32) is not an integer type")
    mm("dtype_code", mm_idx(code=9), F, "dtype code 9 is not one Megatron defines")
    mm("truncated", mm_idx()[:-8], F, "sequence_count 5 and document_count 5 make a 134-byte index, but the file holds 126 bytes")
    mm("huge_counts", mm_idx(nseq=1 << 62), F, "sequence_count 4611686018427387904 and document_count 5 are too "
       "large for any index")
    mm("trailing", mm_idx(tail=b"abc"), F, "3 bytes follow the document indices")
    mm("multimodal", mm_idx(tail=b"\0" * 5), "TKD_ERR_UNSUPPORTED", "a multimodal index")
    mm("no_docs", mm_idx(docs=[]), F, "document_count is 0")
    mm("doc0", mm_idx(docs=[1, 2, 2, 4, 5]), F, "document_indices[0] = 1 (expected 0)")
    mm("doc_decreasing", mm_idx(docs=[0, 3, 2, 5]), F,
       "document_indices[2] = 2 is below document_indices[1] = 3: they must not decrease")
    mm("doc_end", mm_idx(docs=[0, 2, 4]), F, "document_indices ends at 4, but sequence_count is 5")
    mm("size_negative", mm_idx(sizes=[3, -1, 4, 0, 1], pointers=[0, 6, 4, 12, 12]), F, "sizes[1] = -1 is negative")
    mm("bin_short", mm_idx(), F, "tok_mm_bin_short.bin: 16 bytes, but the sizes in", nbin=16)
    mm("bin_long", mm_idx(), F, "tok_mm_bin_long.bin: 21 bytes, but the sizes", nbin=21)
    mm("pointer_past", mm_idx(pointers=[0, 6, 10, 18, 1000]), F,
       "pointers[4] = 1000 puts sequence 4 (2 bytes) outside")
    mm("pointer_gap", mm_idx(pointers=[0, 6, 12, 18, 18]), F,
       "pointers[2] = 12, but the sequences before it end at byte 10")
    mm("no_bin", mm_idx(), "TKD_ERR_NOT_FOUND", "tok_mm_no_bin.bin: cannot open the data file of Megatron index",
       nbin=None)


def flags(name, sidecar, status, substring, ntok=4):
    """tok_flags_<name>.bin (the row): a good llm.c file of ntok uint16 tokens, with a broken flags
    sidecar tok_flags_<name>.bin.flags.npy beside it."""
    with open(os.path.join(OUT, "tok_flags_%s.bin.flags.npy" % name), "wb") as f:
        f.write(sidecar)
    put("tok_flags_%s.bin" % name, tok_bin(20240520, 1, ntok, struct.pack("<%dH" % ntok, *range(ntok))), status,
        substring)


def flags_cases():
    """Flags sidecars (docs/data-formats.md), one defect each."""
    u1 = "{'descr': '|u1', 'fortran_order': False, 'shape': (%d,), }"
    flags("short", npy(u1 % 3, b"\x03\x01\x00"), "TKD_ERR_MISMATCH", "3 flags, but its token file")
    flags("long", npy(u1 % 5, b"\x03\x01\x00\x01\x00"), "TKD_ERR_MISMATCH", "holds 4 tokens")
    flags("bits", npy(u1 % 4, b"\x03\x01\x80\x01"), F, "byte 2 is 0x80: bits 2-7 are reserved")
    flags("dtype", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", b"\0" * 16),
          "TKD_ERR_UNSUPPORTED", "dtype '<i4' is not supported for a flags sidecar")
    flags("2d", npy("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2), }", b"\0" * 4),
          "TKD_ERR_UNSUPPORTED", "a flags sidecar is 1-D")
    flags("truncated", npy(u1 % 4, b"\x01\x01"), F, "truncated: the header promises 4 tokens")
    flags("not_npy", b"flags", F, "npy header runs past the end of the file")


def fuzz_seed():
    """Small valid files to seed tests/fuzz/: a safetensors file (F32, BF16, F16, I64, U8, an empty
    tensor), two token files and recipes for fuzz_shard. (corpus/manifest.yaml comes from
    teacher-dump: see tests/fuzz/README.md.)"""
    d = os.path.join(HERE, "fuzz", "corpus")
    os.makedirs(d, exist_ok=True)
    hdr = {"__metadata__": {"format": "pt"},
           "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
           "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
           "c": {"dtype": "F16", "shape": [1], "data_offsets": [22, 24]},
           "d": {"dtype": "I64", "shape": [1], "data_offsets": [24, 32]},
           "e": {"dtype": "U8", "shape": [0], "data_offsets": [32, 32]}}
    data = struct.pack("<4f3HHq", 1.0, -2.0, 0.5, 3.0, 0x3f80, 0xc000, 0x3e00, 0x3c00, 7)
    with open(os.path.join(d, "valid_small.safetensors"), "wb") as f:
        f.write(st(hdr, data))
    # token files for fuzz_tokens: a 2-D int64 .npy and a uint16 llm.c .bin
    with open(os.path.join(d, "valid_tokens.npy"), "wb") as f:
        f.write(npy("{'descr': '<i8', 'fortran_order': False, 'shape': (3, 4), }", struct.pack("<12q", *range(12))))
    with open(os.path.join(d, "valid_tokens.bin"), "wb") as f:
        f.write(tok_bin(20240520, 1, 6, struct.pack("<6H", 5, 4, 3, 2, 1, 0)))
    # a flags sidecar for fuzz_flags (its token file has 64 tokens): two documents, some trained
    with open(os.path.join(d, "valid_flags.npy"), "wb") as f:
        f.write(npy("{'descr': '|u1', 'fortran_order': False, 'shape': (64,), }",
                    bytes([2] + [0] * 9 + [1] * 22 + [2] + [0] * 7 + [1] * 24)))
    # recipes for fuzz_shard (see its header): untouched shards of each dtype, with and without
    # tail draws; one with a root attribute rewritten; one with a byte flipped in the first chunk
    recipes = {
        "shard_half.recipe": bytes([0, 7, 7, 3, 0]),
        "shard_bf16_tail.recipe": bytes([5, 3, 2, 5, 0]),
        "shard_f32.recipe": bytes([2, 0, 0, 0, 0]),
        "shard_attr_edit.recipe": bytes([0, 3, 3, 1, 1, 10, 1]) + struct.pack("<q", 99),
        "shard_flip.recipe": bytes([4, 2, 4, 2, 0]) + bytes([0] * 40 + [0x10]),
    }
    for name, data in recipes.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)


def main():
    os.makedirs(OUT, exist_ok=True)
    fuzz_seed()
    safetensors_cases()
    token_cases()
    hf_config_cases()
    manifest_cases()
    yaml_config_cases()
    llmc_cases()
    megatron_cases()
    flags_cases()
    with open(os.path.join(OUT, "EXPECTED.tsv"), "w") as f:
        f.write("# file\tstatus\tmessage substring (written by tests/make_broken_files.py)\n")
        for r in rows:
            f.write("\t".join(r) + "\n")
    print("wrote %d files to %s" % (len(rows), OUT))


if __name__ == "__main__":
    main()
