#!/usr/bin/env bash
# Seeds .paper-state/ (what scripts/paper_pending.sh starts from) in a checkout that lacks
# it: the committed results of GPU (default H200) -- each script's CSV, table and
# .meta.json from artifacts/results/GPU/, which is all a run needs to skip what was
# measured -- and the commit.  No tuning cache: the first tunes are cold.  An existing
# .paper-state/results is left as it is (exit 2), since it may hold lines not committed yet.
#
#   bash scripts/paper_state.sh [GPU]
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=${1:-H200}
from=artifacts/results/$gpu
if [ ! -d "$from" ]; then
  echo "$0: no $from (the GPUs with results: $(ls artifacts/results | tr '\n' ' '))" >&2
  exit 2
fi
if [ -d .paper-state/results ]; then
  echo "$0: .paper-state/results is there already; move it away to seed it again" >&2
  exit 2
fi
mkdir -p .paper-state/results
for name in figure9_10 figure10b figure11 figure13 table4 table5; do
  for file in "$from/$name.csv" "$from/$name.md" "$from/$name.meta.json"; do
    if [ -f "$file" ]; then cp "$file" .paper-state/results/; fi
  done
done
git rev-parse --short HEAD > .paper-state/commit 2>/dev/null || true
echo "seeded .paper-state/results from $from ($(ls .paper-state/results | wc -l) files)"
