"""Builds debian_sections.csv: Debian package descriptions labelled by their archive section.

    apt-get update && python3 make_dataset.py            # reads `apt-cache dumpavail`
    python3 make_dataset.py Packages                      # or a Packages index file

One row per package: split (train/test), label (the section), package, text (the package's
short description: the Packages index carries no long descriptions). Packages of the main archive only (no "contrib/" or
"non-free/" section prefix); descriptions that occur twice (translations of one template, -dbg
and -data variants) are kept once. The same index gives the same file: packages are sorted by
name and sampled with a fixed seed.
"""

import csv
import random
import subprocess
import sys
from pathlib import Path

SECTIONS = ("database", "fonts", "games", "mail", "science", "sound")
PER_SECTION = 200
TEST_PER_SECTION = 50
MAX_CHARS = 400
SEED = 2024


def stanzas(text):
    record, key = {}, None
    for line in text.splitlines():
        if not line.strip():
            if record:
                yield record
            record, key = {}, None
        elif line[0] in " \t" and key:
            record[key] += "\n" + line
        elif ":" in line:
            key, _, value = line.partition(":")
            record[key] = value.strip()
    if record:
        yield record


def description(record):
    text = record.get("Description", "").split("\n")[0]
    return " ".join(text.split())[:MAX_CHARS]


def main():
    if len(sys.argv) > 1:
        source = Path(sys.argv[1]).read_text(encoding="utf-8", errors="replace")
    else:
        source = subprocess.run(["apt-cache", "dumpavail"], capture_output=True, text=True, check=True).stdout
    by_section = {s: {} for s in SECTIONS}
    seen = set()
    for r in sorted(stanzas(source), key=lambda r: r.get("Package", "")):
        section, name = r.get("Section", ""), r.get("Package", "")
        if section not in by_section or name.endswith(("-dbg", "-dbgsym", "-doc")):
            continue
        text = description(r)
        key = text.lower()
        if len(text) < 12 or key in seen:
            continue
        seen.add(key)
        by_section[section][name] = text
    rng = random.Random(SEED)
    rows = []
    for section in SECTIONS:
        names = sorted(by_section[section])
        if len(names) < PER_SECTION:
            sys.exit(f"section {section}: only {len(names)} usable packages, need {PER_SECTION}")
        chosen = rng.sample(names, PER_SECTION)
        for k, name in enumerate(chosen):
            rows.append(("test" if k < TEST_PER_SECTION else "train", section, name, by_section[section][name]))
    out = Path(__file__).with_name("debian_sections.csv")
    with out.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(("split", "label", "package", "text"))
        w.writerows(rows)
    print(f"{out}: {len(rows)} rows, {len(SECTIONS)} sections")


if __name__ == "__main__":
    main()
