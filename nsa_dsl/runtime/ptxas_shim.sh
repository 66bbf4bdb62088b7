# The body of the ptxas wrapper that nsa_dsl.runtime.ptxas_cache installs first on PATH; the lines
# above this one (written by ptxas_cache) set `real`, the ptxas it stands in for, and `store`, the
# directory of compiled binaries.
#
# A call it can answer from the store is `ptxas [options] INPUT [options] -o OUTPUT [options]`:
# exactly one argument that is not an option and every option but -o written as one word
# (`-arch=sm_90a`, as XLA and jaxlib write them). Anything else (`--version`, an option with a
# separate value) goes to the real ptxas untouched, and so does every call the store cannot serve.

input=
output=
options=
want_output=
for arg in "$@"; do
  if [ -n "$want_output" ]; then
    output=$arg
    want_output=
    continue
  fi
  case $arg in
    -o) want_output=1 ;;
    -*) options="$options
$arg" ;;
    *)
      [ -z "$input" ] || exec "$real" "$@"
      input=$arg
      ;;
  esac
done
[ -n "$input" ] && [ -n "$output" ] && [ -r "$input" ] || exec "$real" "$@"

key=$({ printf '%s\n' "$options"; cat "$input"; } | sha256sum) || exec "$real" "$@"
key=${key%% *}

# An entry is KEY.cubin, KEY.log (what ptxas wrote to stderr: XLA reads its spill warnings) and
# KEY.sha256, the checksums of the other two, moved into place last. An entry whose checksums do
# not match (torn by a crash, overwritten by a racing writer, damaged) is compiled again.
if [ -f "$store/$key.sha256" ] &&
  [ "$(cd "$store" && sha256sum "$key.cubin" "$key.log" 2>/dev/null)" = "$(cat "$store/$key.sha256")" ] &&
  cp "$store/$key.cubin" "$output" 2>/dev/null; then
  cat "$store/$key.log" >&2
  exit 0
fi

# Files of a writer in progress carry its process id, so racing writers never share one.
partial=$store/.$key.$$
mkdir -p "$store" 2>/dev/null && { true >"$partial.log"; } 2>/dev/null || exec "$real" "$@"
"$real" "$@" 2>"$partial.log"
status=$?
cat "$partial.log" >&2
if [ "$status" -eq 0 ] && cp "$output" "$partial.cubin" 2>/dev/null &&
  mv -f "$partial.log" "$store/$key.log" && mv -f "$partial.cubin" "$store/$key.cubin"; then
  sums=$(cd "$store" && sha256sum "$key.cubin" "$key.log") &&
    printf '%s\n' "$sums" >"$partial.sha256" && mv -f "$partial.sha256" "$store/$key.sha256"
fi
rm -f "$partial.log" "$partial.cubin" "$partial.sha256"
exit "$status"
