# Sourced by scripts/test and scripts/test-compat (after $PY is set): the suite's XLA compilation
# cache. Every process of a run shares it (tests/conftest.py); by default .cache/xla in the
# repository, kept between runs. TPUDIST_CACHE_DIR=off: none.
#
# JAX's own size cap (JAX_COMPILATION_CACHE_MAX_SIZE) scans the directory under a lock at every
# write, which cost the suite a fifth of its time; the cache is uncapped while tests run and pruned
# here instead, before they start: least recently written entries first, down to
# TPUDIST_TEST_CACHE_GIB (default 2).
export TPUDIST_CACHE_DIR="${TPUDIST_CACHE_DIR:-$ROOT/.cache/xla}"
export JAX_COMPILATION_CACHE_MAX_SIZE="${JAX_COMPILATION_CACHE_MAX_SIZE:--1}"
if [ -d "$TPUDIST_CACHE_DIR" ]; then
  "$PY" - "$TPUDIST_CACHE_DIR" "${TPUDIST_TEST_CACHE_GIB:-2}" <<'PRUNE'
import os, sys
directory, cap = sys.argv[1], float(sys.argv[2]) * (1 << 30)
entries = []
for entry in os.scandir(directory):
    if entry.is_file():
        stat = entry.stat()
        entries.append((stat.st_mtime, stat.st_size, entry.path))
total = sum(size for _, size, _ in entries)
for _, size, path in sorted(entries):
    if total <= cap:
        break
    os.remove(path)
    total -= size
PRUNE
fi
