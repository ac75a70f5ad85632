# Sourced by scripts/test and scripts/test-compat: sets `parallel`, the pytest arguments that run
# test files in parallel, one file per worker (pytest-xdist's loadfile: a module's shared process
# pools and fixtures start once). TPUDIST_TEST_WORKERS of them, by default the machine's cores up
# to 4; 1 (or `-n 0` among pytest's arguments) runs them one after another in one process.
workers="${TPUDIST_TEST_WORKERS:-$(nproc)}"
[ "$workers" -le 4 ] || workers=4
parallel=()
[ "$workers" -le 1 ] || parallel=(-n "$workers" --dist loadfile)
