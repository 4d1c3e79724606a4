#!/usr/bin/env python3
"""Writes token files in the layouts other tools write, with the Python standard library only.

Not run by CI. It follows, step for step, the writers users' files come from (see
docs/data-formats.md for the layouts):
  - llm.c: dev/data/data_common.py write_datafile — a header of 256 little-endian int32 (magic,
    version, token count, then zeros) followed by the tokens, uint16 for "gpt-2" (magic 20240520,
    version 1) or uint32 for "llama-3" (magic 20240801, version 7);
  - Megatron-LM: megatron/core/datasets/indexed_dataset.py IndexedDatasetBuilder (add_item,
    end_document, finalize) and _IndexWriter — PREFIX.bin holds the sequences back to back,
    PREFIX.idx the index.

    python3 tests/write_token_files.py fixtures                 # remakes tests/data/tokens/ (test_tokens.c reads it)
    python3 tests/write_token_files.py llmc llama-3 out.bin 128000 9906 1917
    python3 tests/write_token_files.py megatron uint16 out "15496 995 50256" "464 2068 50256"
        (each quoted argument is one document of one sequence, as Megatron's
        tools/preprocess_data.py writes without --split-sentences)
"""
import os
import struct
import sys

LLMC_HEADERS = {
    "gpt-2": {"magic": 20240520, "version": 1, "fmt": "H"},
    "llama-3": {"magic": 20240801, "version": 7, "fmt": "I"},
}

# Megatron's DType codes and the struct format of each
MEGATRON_DTYPES = {"uint8": (1, "B"), "int8": (2, "b"), "int16": (3, "h"), "int32": (4, "i"), "int64": (5, "q"),
                   "float64": (6, "d"), "float32": (7, "f"), "uint16": (8, "H")}


def write_llmc(filename, toks, model_desc="gpt-2"):
    """llm.c's write_datafile: header of 256 int32, then the tokens."""
    assert len(toks) < 2**31, "token count too large"
    info = LLMC_HEADERS[model_desc]
    header = [0] * 256
    header[0] = info["magic"]
    header[1] = info["version"]
    header[2] = len(toks)
    with open(filename, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%d%s" % (len(toks), info["fmt"]), *toks))


class MegatronBuilder:
    """IndexedDatasetBuilder: sequences go to the .bin as they come; finalize writes the .idx."""

    def __init__(self, bin_path, dtype="int32"):
        self.code, self.fmt = MEGATRON_DTYPES[dtype]
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths = []
        self.document_indices = [0]

    def add_item(self, tokens):
        self.data_file.write(struct.pack("<%d%s" % (len(tokens), self.fmt), *tokens))
        self.sequence_lengths.append(len(tokens))

    def end_document(self):
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths):
        self.data_file.write(struct.pack("<%d%s" % (len(tokens), self.fmt), *tokens))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self, idx_path):
        self.data_file.close()
        itemsize = struct.calcsize("<" + self.fmt)
        pointers, at = [], 0
        for n in self.sequence_lengths:  # _IndexWriter._sequence_pointers
            pointers.append(at)
            at += n * itemsize
        n_seq, n_doc = len(self.sequence_lengths), len(self.document_indices)
        with open(idx_path, "wb") as f:
            f.write(b"MMIDIDX\x00\x00")
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", self.code))
            f.write(struct.pack("<Q", n_seq))
            f.write(struct.pack("<Q", n_doc))
            f.write(struct.pack("<%di" % n_seq, *self.sequence_lengths))
            f.write(struct.pack("<%dq" % n_seq, *pointers))
            f.write(struct.pack("<%dq" % n_doc, *self.document_indices))


def write_megatron(prefix, documents, dtype="int32"):
    """documents: a list of documents, each a list of sequences (lists of token ids)."""
    b = MegatronBuilder(prefix + ".bin", dtype)
    for doc in documents:
        for sequence in doc:
            b.add_item(sequence)
        b.end_document()
    b.finalize(prefix + ".idx")


# The fixtures of tests/data/tokens/; test_tokens.c (test_python_written_files) holds the same ids.
GPT2_TOKENS = [50256, 15496, 995, 50256, 464, 2068, 65535]  # EOT before each document, as fineweb.py
LLAMA3_TOKENS = [128000, 9906, 1917, 128000, 791, 4062, 128255, 2147483647]
MEGATRON_U16_DOCS = [[[15496, 995, 50256]], [[464, 2068, 50256]]]  # --append-eod, one sequence each
MEGATRON_I32_DOCS = [[[128000, 9906, 1917], [13, 128001]], [], [[791, 4062, 128001]]]  # split sentences, an empty doc


def fixtures():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tokens")
    os.makedirs(out, exist_ok=True)
    write_llmc(os.path.join(out, "llmc_gpt2.bin"), GPT2_TOKENS, "gpt-2")
    write_llmc(os.path.join(out, "llmc_llama3.bin"), LLAMA3_TOKENS, "llama-3")
    write_megatron(os.path.join(out, "megatron_uint16"), MEGATRON_U16_DOCS, "uint16")
    write_megatron(os.path.join(out, "megatron_int32"), MEGATRON_I32_DOCS, "int32")
    print("wrote the fixtures in %s" % out)


def main(argv):
    if argv[:1] == ["fixtures"]:
        fixtures()
    elif len(argv) >= 3 and argv[0] == "llmc":
        write_llmc(argv[2], [int(t) for t in argv[3:]], argv[1])
    elif len(argv) >= 3 and argv[0] == "megatron":
        write_megatron(argv[2], [[[int(t) for t in doc.split()]] for doc in argv[3:]], argv[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
