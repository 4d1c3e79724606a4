// Renders every chat template x conversation in tests/data/chat_templates/conversations.json with
// Hugging Face's own Jinja implementation (@huggingface/jinja) and writes the expected outputs the C
// interpreter must reproduce byte for byte (tests/test_jinja.c).
//   cd /tmp/hfjinja && npm install @huggingface/jinja
//   NODE_PATH=/tmp/hfjinja/node_modules node tests/chat_template_reference.mjs
// A render that throws (raise_exception) is written as <name>.err holding the message.
import { createRequire } from "module";
import fs from "fs";
import path from "path";
import { fileURLToPath } from "url";

const require = createRequire(import.meta.url);
const { Template } = require(process.env.HF_JINJA || "@huggingface/jinja");
const dir = path.join(path.dirname(fileURLToPath(import.meta.url)), "data", "chat_templates");
const corpus = JSON.parse(fs.readFileSync(path.join(dir, "conversations.json"), "utf8"));

// strftime_now reads the clock: pin it to corpus.now (in UTC) so the outputs are reproducible.
process.env.TZ = "UTC";
const RealDate = Date;
const fixed = new RealDate(corpus.now).getTime();
globalThis.Date = class extends RealDate {
  constructor(...a) { super(...(a.length ? a : [fixed])); }
  static now() { return fixed; }
};

const outDir = path.join(dir, "expected");
fs.mkdirSync(outDir, { recursive: true });
for (const f of fs.readdirSync(outDir)) fs.unlinkSync(path.join(outDir, f));
for (const t of corpus.templates) {
  const tmpl = new Template(fs.readFileSync(path.join(dir, t.file), "utf8"));
  for (const c of corpus.conversations) {
    const ctx = { ...c.context };
    if (t.bos_token !== null) ctx.bos_token = t.bos_token;
    if (t.eos_token !== null) ctx.eos_token = t.eos_token;
    const base = path.join(outDir, `${t.file.replace(/\.jinja$/, "")}__${c.name}`);
    try {
      fs.writeFileSync(base + ".txt", tmpl.render(ctx));
    } catch (e) {
      fs.writeFileSync(base + ".err", String(e.message) + "\n");
    }
  }
}
