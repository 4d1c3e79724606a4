#!/usr/bin/env python3
"""Reference token ids and assistant masks for tests/test_chat_tokenize.c (`test_chat_tokenize
fixtures`), made by transformers from local files only (no network).

For each case of tests/data/chat/cases.tsv (name, template, kwargs) and each record of
tests/data/chat/conversations.jsonl, with the tokenizer tests/data/chat/tokenizer/ (written by
tests/data/chat/make_tokenizer.py):
  - a template with {% generation %} blocks and a "messages" record:
    apply_chat_template(..., tokenize=True, return_dict=True, return_assistant_tokens_mask=True);
  - otherwise TRL's completion-only rule on character spans: for each assistant message i, what
    render(messages[:i+1]) adds after render(messages[:i], add_generation_prompt=True) (for
    prompt/completion: what the whole render adds after the prompt's), a token trained when its
    offsets (return_offsets_mapping) overlap a span; the ids are tokenizer(render,
    add_special_tokens=False), checked against apply_chat_template(tokenize=True).
A render that raises, or whose prefixes are not prefixes of the whole render, is an "error" line.

Writes tests/fixtures/chat/<case>.txt, one line per record and kind:
    <line> ids <id> <id> ...
    <line> mask <0|1> <0|1> ...
    <line> error <message>

Run on the GPU machine (transformers 5.x, jinja2), from the repository root:
    HF_HUB_OFFLINE=1 python3 tests/chat_mask_reference.py
then here: commit tests/fixtures/chat/ (CMake then registers test_chat_tokenize_transformers).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "chat")


def load_tokenizer():
    path = os.path.join(HERE, "data", "chat", "tokenizer")
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # an older or newer AutoTokenizer that cannot map the class name
        print(f"AutoTokenizer failed ({e}); using PreTrainedTokenizerFast", file=sys.stderr)
        from transformers import PreTrainedTokenizerFast
        cfg = json.load(open(os.path.join(path, "tokenizer_config.json")))
        return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                       bos_token=cfg["bos_token"], eos_token=cfg["eos_token"],
                                       pad_token=cfg["pad_token"])


def conversation(rec):
    """(messages, tools, number of prompt messages or None)"""
    if "messages" in rec:
        return rec["messages"], rec.get("tools"), None
    p, c = rec["prompt"], rec["completion"]
    pm = [{"role": "user", "content": p}] if isinstance(p, str) else p
    cm = [{"role": "assistant", "content": c}] if isinstance(c, str) else c
    return pm + cm, rec.get("tools"), len(pm)


def one_record(tok, tmpl, kwargs, rec):
    msgs, tools, nprompt = conversation(rec)

    def render(m, gen):
        return tok.apply_chat_template(m, tools=tools, chat_template=tmpl, tokenize=False,
                                       add_generation_prompt=gen, **kwargs)

    full = render(msgs, False)
    if "generation" in tmpl and "endgeneration" in tmpl and nprompt is None:
        out = tok.apply_chat_template(msgs, tools=tools, chat_template=tmpl, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **kwargs)
        return list(out["input_ids"]), list(out["assistant_masks"])
    if nprompt is not None:
        pairs = [(nprompt, len(msgs))]
    else:
        pairs = [(i, i + 1) for i, m in enumerate(msgs) if m["role"] == "assistant"]
    spans = []
    for a, b in pairs:
        p = render(msgs[:a], True)
        q = full if b == len(msgs) else render(msgs[:b], False)
        if not (full.startswith(p) and q.startswith(p) and full.startswith(q)):
            raise ValueError("prefix: the renders of the conversation's prefixes do not begin the whole render")
        spans.append((len(p), len(q)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    direct = tok.apply_chat_template(msgs, tools=tools, chat_template=tmpl, tokenize=True, return_dict=True,
                                     **kwargs)["input_ids"]
    if list(direct) != ids:
        raise SystemExit(f"apply_chat_template(tokenize=True) differs from tokenizer(render): {direct} vs {ids}")
    mask = [int(any(s < e and s < te and ts < e for s, e in spans)) for ts, te in enc["offset_mapping"]]
    return ids, mask


def main():
    tok = load_tokenizer()
    os.makedirs(OUT, exist_ok=True)
    records = [json.loads(l) for l in open(os.path.join(HERE, "data", "chat", "conversations.jsonl"))]
    for row in open(os.path.join(HERE, "data", "chat", "cases.tsv")):
        name, tpath, kw = row.rstrip("\n").split("\t")
        tmpl = open(os.path.join(HERE, tpath)).read()
        lines = []
        for n, rec in enumerate(records, 1):
            try:
                ids, mask = one_record(tok, tmpl, json.loads(kw), rec)
                lines.append(f"{n} ids " + " ".join(map(str, ids)))
                lines.append(f"{n} mask " + " ".join(map(str, mask)))
            except SystemExit:
                raise
            except Exception as e:  # the template raised, or the prefix rule cannot apply
                lines.append(f"{n} error " + " ".join(str(e).split()))
        with open(os.path.join(OUT, name + ".txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"{name}: {len(records)} records -> tests/fixtures/chat/{name}.txt")


if __name__ == "__main__":
    main()
