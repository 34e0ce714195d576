# Sourced by the one-commit-against-this-tree benches (serving_cpu_compare.sh,
# protocol_compare.sh) after they set `out` and `before`: makes OUT absolute, checks BEFORE
# out into a temporary worktree `wt` (removed on exit), sets `repo` and `py`, and moves to
# OUT. `python -m deploy.cli` puts its working directory first on sys.path: running from one
# that holds no package makes each side import only the tree its PYTHONPATH names.
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$out" || exit 1
wt=$(mktemp -d)/before
git -C "$repo" worktree add -q --detach "$wt" "$before" || exit 1
trap 'git -C "$repo" worktree remove --force "$wt"' EXIT
