#!/bin/sh
# failsummary.sh LOG: the failures of a `go test` log, short. For each
# "--- FAIL" line, the last lines its test printed from a _test.go file
# (t.Errorf/t.Fatalf and the t.Logf just before them), each cut to 400
# characters: a long run's reasons at the end of the output, where CI's
# excerpt shows them.
set -eu
awk '
function flush(   i, n) {
	if (name == "") return
	print name
	n = (count < keep) ? count : keep
	for (i = count - n; i < count; i++) print "    " substr(buf[i % keep], 1, 400)
	name = ""; count = 0
}
BEGIN { keep = 12 }
/^[ \t]*--- FAIL/ { flush(); name = $0; next }
/^(FAIL|ok)[ \t]/ { flush(); if ($1 == "FAIL") print; next }
name != "" && /^[ \t]+[A-Za-z0-9_]+_test\.go:[0-9]+: / {
	sub(/^[ \t]+/, ""); buf[count % keep] = $0; count++
}
END { flush() }
' "$1"
