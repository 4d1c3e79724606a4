#!/usr/bin/env python3
"""Writes tests/data/chat/tokenizer/: a small byte-level BPE tokenizer.json in the layout of Qwen2's
(NFC normalizer, Qwen's Split pattern + ByteLevel, ByteLevel decoder), with the special tokens of the
Qwen and Llama 3 chat templates, and its tokenizer_config.json. Python standard library only;
deterministic. The merges are learned from the chat-template test corpus, then two whitespace merges
("\\n\\n", "\\n\\n\\n") are put first so that a token can straddle the edge of an assistant turn
(tests/test_chat_tokenize.c checks that case).

    python3 tests/data/chat/make_tokenizer.py
"""
import collections
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
N_MERGES = 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as in Qwen3)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def corpus():
    text = []
    conv = json.load(open(os.path.join(HERE, "..", "chat_templates", "conversations.json")))
    def walk(v):
        if isinstance(v, str):
            text.append(v)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
    walk(conv)
    text.append("You are a helpful assistant. system user assistant The quick brown fox jumps over the lazy dog.")
    return "\n".join(text)


def learn_merges(b2u):
    words = collections.Counter(re.findall(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+", corpus()))
    seqs = {w: tuple(b2u[b] for b in w.encode("utf-8")) for w in words}
    merges = [("Ċ", "Ċ"), ("ĊĊ", "Ċ")]
    for w in seqs:  # the fixed merges first, as the trainer would have learned them
        for a, b in merges:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = tuple(out)
    while len(merges) < N_MERGES:
        pairs = collections.Counter()
        for w, s in seqs.items():
            for p in zip(s, s[1:]):
                pairs[p] += words[w]
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = tuple(out)
    return merges


def main():
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(sorted(b2u))}
    merges = learn_merges(b2u)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    added = []
    for i, t in enumerate(SPECIALS + ADDED):
        added.append({"id": len(vocab) + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": t in SPECIALS})
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False}, bl]},
        "post_processor": bl, "decoder": bl,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
           "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|endoftext|>",
           "unk_token": None, "model_max_length": 131072}
    out = os.path.join(HERE, "tokenizer")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
        f.write("\n")
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
