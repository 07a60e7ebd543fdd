#!/usr/bin/env bash
# Every C++ file of the tree is formatted as .clang-format says (clang-format 14, Debian 12's: other
# versions format some constructs differently, so they skip with exit 77 instead of failing).
#   format_check.sh SOURCE_DIR [CLANG_FORMAT]
# Fails naming each unformatted file and the command that fixes it.
set -u
src=$1
cf=${2:-clang-format}
if ! command -v "$cf" >/dev/null 2>&1; then
  echo "skipped: $cf is not installed (apt-get install clang-format)"; exit 77
fi
version=$("$cf" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$version" != 14 ]; then
  echo "skipped: $cf is version $version; the tree is formatted with clang-format 14"; exit 77
fi
cd "$src" || exit 1
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -co --exclude-standard '*.h' '*.cc' '*.cu' '*.cuh')
else
  mapfile -t files < <(find include src tests examples tools bench -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh')
fi
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  "$cf" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
echo "checked ${#files[@]} files with $("$cf" --version)"
if [ ${#bad[@]} -gt 0 ]; then
  echo "not formatted per .clang-format (${#bad[@]}):"
  printf '  %s\n' "${bad[@]}"
  echo "fix: clang-format -i ${bad[*]}"
  exit 1
fi
echo "ok: every file is formatted"
