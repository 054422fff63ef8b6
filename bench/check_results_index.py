#!/usr/bin/env python3
"""Check that every measured-results path the documentation cites exists.

    python3 bench/check_results_index.py        (from anywhere in the repository)

Reads README.md, docs/*.md, bench/results/README.md (the index of figures) and the per-machine READMEs
bench/results/<machine>/README.md, and checks:
- every `bench/results/...` path in any of them, from the repository root;
- in the index: every path in backticks or in a markdown link, relative to bench/results/; a bare file name
  (`.log`, `moe-x.json`) names a file beside the last full path of the same line;
- in a machine's README: every file or folder name in backticks, relative to that machine's folder, a bare
  name anywhere below it (its sections name the files of their run folder);
- in README.md and docs/: every `tools/device/<script>` they name.
A path may use {a,b} alternatives and * ? globs: each alternative must match at least one file. Paths outside
the repository (../shared/...) and code paths in the machine READMEs (tools/, src/, ...: the commands that made
a run, as they were) are not checked. Exit status 0 when every path exists, 1 otherwise (one line per missing
path: the citing file, its line and the path).
"""
import fnmatch
import glob
import itertools
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
FILE_EXT = (".json", ".log", ".txt", ".md", ".csv", ".out", ".gz", ".xz")
CODE_PREFIXES = ("tools/", "src/", "include/", "tests/", "python/", "examples/", "docs/", "scripts/", "build/",
                 "/", "$", "~")


def code_path(token):
    """A path of the source tree (a bare `python/` is a run's folder of that name)."""
    return token != "python/" and token.startswith(CODE_PREFIXES)


def expand_braces(path):
    """'a{1,2}b' -> ['a1b', 'a2b'] (nested braces are not used here)."""
    parts = re.split(r"(\{[^{}]*\})", path)
    choices = [p[1:-1].split(",") if p.startswith("{") and p.endswith("}") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def exists(path):
    """path (absolute, may hold globs and braces): every alternative matches something."""
    for alt in expand_braces(path):
        if not glob.glob(alt.rstrip("/") or "/"):
            return False
    return True


def lines_outside_fences(text):
    """(line number, line) pairs, fenced code blocks blanked (their paths are checked by the bench/results regex only)."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            yield n, "", line
            continue
        yield n, ("" if fenced else line), line


def clean(token):
    return token.strip().rstrip(".,;:)").strip("*")


def looks_like_path(token):
    return (token and " " not in token and "=" not in token and not token.startswith("-")
            and "://" not in token and (token.endswith("/") or token.lower().endswith(FILE_EXT)))


def results_paths(line):
    return [clean(m) for m in re.findall(r"bench/results(?:/[A-Za-z0-9_.{},*?+-]*)*/?", line)]


def main():
    missing = []

    def need(cited_in, n, shown, absolute):
        if not exists(absolute):
            missing.append(f"{os.path.relpath(cited_in, ROOT)}:{n}: {shown}")

    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    index = os.path.join(RESULTS, "README.md")
    machines = sorted(glob.glob(os.path.join(RESULTS, "*", "README.md")))

    for doc in docs + [index] + machines:
        if not os.path.exists(doc):
            missing.append(f"{os.path.relpath(doc, ROOT)}: (the file itself)")
            continue
        text = open(doc, encoding="utf-8").read()
        for n, prose, raw in lines_outside_fences(text):
            for p in results_paths(raw):
                need(doc, n, p, os.path.join(ROOT, p))
            if doc in docs:
                for script in re.findall(r"tools/device/[A-Za-z0-9_.-]+", prose):
                    need(doc, n, clean(script), os.path.join(ROOT, clean(script)))
                continue
            tokens = [clean(t) for t in re.findall(r"`([^`]+)`", prose)]
            tokens += [clean(t) for t in re.findall(r"\]\(([^)#]+)\)", prose)]
            if doc == index:
                last = None  # the last full path of this line: bare names sit beside it
                for t in tokens:
                    if not looks_like_path(t) or t.startswith("bench/results") or code_path(t):
                        continue
                    if t.startswith("../"):
                        if not os.path.abspath(os.path.join(RESULTS, t)).startswith(ROOT + os.sep):
                            continue  # outside the repository
                    if "/" in t.rstrip("/"):
                        last = os.path.join(RESULTS, t)
                        need(doc, n, t, last)
                    elif last is not None:
                        if t.startswith("."):  # `.log`: the same stem, another extension
                            base = os.path.splitext(expand_braces(last)[0])[0]
                            need(doc, n, t, base + t)
                        else:  # beside the last file, or inside the last folder
                            base = last if last.endswith("/") else os.path.dirname(last)
                            need(doc, n, t, os.path.join(base, t))
                    else:
                        need(doc, n, t, os.path.join(RESULTS, t))
            else:
                folder = os.path.dirname(doc)
                for t in tokens:
                    if (not looks_like_path(t) or t.startswith("bench/results") or code_path(t)
                            or t.startswith(".") and not t.startswith("../")):
                        continue
                    if "/" in t.rstrip("/"):
                        target = os.path.abspath(os.path.join(folder, t))
                        if target.startswith(ROOT + os.sep):
                            need(doc, n, t, target)
                        continue
                    # A bare name: some file (or folder) below this machine's folder.
                    found = True
                    for alt in expand_braces(t):
                        want_dir = alt.endswith("/")
                        name = alt.rstrip("/")
                        hit = False
                        for dirpath, dirnames, filenames in os.walk(folder):
                            names = dirnames if want_dir else filenames
                            if any(fnmatch.fnmatch(x, name) for x in names):
                                hit = True
                                break
                        found = found and hit
                    if not found:
                        missing.append(f"{os.path.relpath(doc, ROOT)}:{n}: {t}")

    if missing:
        print("missing paths cited by the documentation:")
        print("\n".join("  " + m for m in missing))
        return 1
    print(f"ok: every results path cited by README.md, docs/ and bench/results/**/README.md exists "
          f"({len(docs)} docs, {len(machines)} machine READMEs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
