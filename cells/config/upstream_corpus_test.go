package config

import (
	"bufio"
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/hivetest"
	"github.com/cilium/hive/job"
	"github.com/cilium/statedb"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/settings"
	"github.com/ipmasq/ipmasq/tables"
	"github.com/ipmasq/ipmasq/testkit/kubetest"
)

// The differential corpus: every case of testdata/upstream-corpus/CASES
// runs under the real Kubernetes ip-masq-agent (tools/ip-masq-agent) or
// Azure's ip-masq-agent-v2 (tools/ip-masq-agent-v2), each in a network and
// mount namespace of its own with the case's files at /etc/config (an
// overlay over the node's /etc), and under ipmasq's config cell with the
// same files and args. What is compared is the decision: refused (the
// reference writes no MASQUERADE rule), or the no-masquerade prefixes of
// each family, read back from the reference's chain with iptables -S. The
// cases that differ must be exactly the ones docs/migrate.md lists under
// "Differences the corpus shows", each with its reason.

const (
	corpusDir  = "../../testdata/upstream-corpus"
	migrateDoc = "../../docs/migrate.md"
)

// corpusCase is one line of CASES: an id, the agent (v1: the Kubernetes
// agent, v2: ip-masq-agent-v2, given --ip-masq-agent-v2 on ipmasq's side),
// the files (corpus file, or name=corpus file; "-" for none) and the args.
type corpusCase struct {
	id, agent string
	files     map[string]string // name in /etc/config → corpus file
	args      []string
}

func loadCorpus(t *testing.T) []corpusCase {
	t.Helper()
	f, err := os.Open(filepath.Join(corpusDir, "CASES"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var cases []corpusCase
	ids := map[string]bool{}
	used := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		if len(fields) < 3 || (fields[1] != "v1" && fields[1] != "v2") || ids[fields[0]] {
			t.Fatalf("CASES: bad or repeated line %q: want <id> v1|v2 <files> [args]", sc.Text())
		}
		c := corpusCase{id: fields[0], agent: fields[1], files: map[string]string{}, args: fields[3:]}
		ids[c.id] = true
		if fields[2] != "-" {
			for _, spec := range strings.Split(fields[2], ",") {
				name, file, ok := strings.Cut(spec, "=")
				if !ok {
					name, file = "ip-masq-agent", spec
				}
				if _, err := os.Stat(filepath.Join(corpusDir, file)); err != nil {
					t.Fatalf("CASES: %s: %v", c.id, err)
				}
				c.files[name] = file
				used[file] = true
			}
		}
		cases = append(cases, c)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	// Every file of the corpus is in a case.
	des, err := os.ReadDir(corpusDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range des {
		if de.Name() != "CASES" && !used[de.Name()] {
			t.Errorf("testdata/upstream-corpus/%s is in no case of CASES", de.Name())
		}
	}
	return cases
}

// documentedDifferences are the case ids docs/migrate.md lists between
// its corpus markers, each a table row `| `id` | ... |`.
func documentedDifferences(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(migrateDoc)
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(data), "<!-- corpus-differences -->")
	section, _, ok2 := strings.Cut(rest, "<!-- /corpus-differences -->")
	if !ok || !ok2 {
		t.Fatalf("%s has no <!-- corpus-differences --> section", migrateDoc)
	}
	var ids []string
	for _, m := range regexp.MustCompile("(?m)^\\| `([^`]+)` \\|").FindAllStringSubmatch(section, -1) {
		ids = append(ids, m[1])
	}
	slices.Sort(ids)
	return ids
}

// TestUpstreamCorpus runs the corpus under both and checks that the cases
// that differ are the documented ones.
func TestUpstreamCorpus(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root: the reference agents run in network and mount namespaces of their own")
	}
	for _, tool := range []string{"unshare", "iptables", "ip6tables", "mount"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found: %v (util-linux, iptables)", tool, err)
		}
	}
	cases := loadCorpus(t)
	if len(cases) < 40 {
		t.Fatalf("CASES has %d cases, want at least 40", len(cases))
	}
	v1, err := kubetest.UpstreamAgentBinary()
	if err != nil {
		t.Fatal(err)
	}
	v2, err := kubetest.UpstreamV2AgentBinary()
	if err != nil {
		t.Fatal(err)
	}
	var differ []string
	for _, c := range cases {
		bin := v1
		if c.agent == "v2" {
			bin = v2
		}
		ref, log := runReference(t, bin, c)
		got := runIPMasq(t, c)
		if ref != got {
			differ = append(differ, c.id)
			t.Logf("%s (%s %v): differs\n  upstream: %s\n  ipmasq:   %s\n  upstream's log: %s", c.id, c.agent, c.args, ref, got, lastLines(log, 3))
		} else {
			t.Logf("%s: same: %s", c.id, ref)
		}
	}
	slices.Sort(differ)
	if want := documentedDifferences(t); !slices.Equal(differ, want) {
		t.Errorf("the cases that differ are %q; docs/migrate.md documents %q", differ, want)
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], " | ")
}

// referenceScript runs the agent ($1) with its args in fresh namespaces,
// the case's files at /etc/config, until its first sync is done (v1 logs
// its IPv6 rules and its IPv6 chain gets its MASQUERADE rule, or it logs a
// sync error; v2 logs its config, then its chain gets its MASQUERADE rule)
// or it exits, then prints its chains.
const referenceScript = `
set -u
over=$1 bin=$2 chain=$3 agent=$4 log=$5; shift 5
mount -t overlay overlay -o lowerdir="$over:/etc" /etc || exit 97
ip link set lo up
"$bin" "$@" --v=2 --logtostderr >"$log" 2>&1 &
pid=$!
i=0
while [ $i -lt 200 ] && kill -0 $pid 2>/dev/null; do
	if [ $agent = v1 ] && grep -q -e 'Error syncing' -e 'IPv6 masquerading rules: not enabled' "$log"; then break; fi
	# With IPv6, v1 logs its IPv6 rules, then restores them: done once
	# they are in.
	if [ $agent = v1 ] && grep -q 'IPv6 masquerading rules: "' "$log" &&
		ip6tables -w -t nat -S "$chain" 2>/dev/null | grep -q MASQUERADE; then
		break
	fi
	if [ $agent = v2 ] && grep -q 'using config' "$log" && iptables -w -t nat -S "$chain" 2>/dev/null | grep -q MASQUERADE; then
		sleep 0.2; break
	fi
	sleep 0.05; i=$((i+1))
done
kill $pid 2>/dev/null; wait $pid 2>/dev/null
echo '### v4'; iptables -w -t nat -S "$chain" 2>/dev/null
echo '### v6'; ip6tables -w -t nat -S "$chain" 2>/dev/null
exit 0
`

// runReference runs the reference agent on c and returns its decision and
// its log.
func runReference(t *testing.T, bin string, c corpusCase) (string, string) {
	t.Helper()
	dir := t.TempDir()
	over := filepath.Join(dir, "etc")
	if err := os.MkdirAll(filepath.Join(over, "config"), 0o755); err != nil {
		t.Fatal(err)
	}
	for name, file := range c.files {
		data, err := os.ReadFile(filepath.Join(corpusDir, file))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(over, "config", name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	chain := "IP-MASQ-AGENT"
	for _, a := range c.args {
		if v, ok := strings.CutPrefix(a, "--masq-chain="); ok {
			chain = v
		}
	}
	log := filepath.Join(dir, "log")
	args := append([]string{"--net", "--mount", "--propagation", "private", "sh", "-c", referenceScript, "sh", over, bin, chain, c.agent, log}, c.args...)
	out, err := exec.Command("unshare", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: the reference: %v\n%s", c.id, err, out)
	}
	logData, _ := os.ReadFile(log)
	v4, v6, _ := strings.Cut(strings.TrimPrefix(string(out), "### v4\n"), "### v6\n")
	var fam [2][]netip.Prefix
	masq := [2]bool{}
	for i, rules := range []string{v4, v6} {
		for _, line := range strings.Split(rules, "\n") {
			f := strings.Fields(line)
			switch {
			case len(f) == 0 || f[0] != "-A":
			case slices.Contains(f, "MASQUERADE"):
				masq[i] = true
			case slices.Contains(f, "RETURN"):
				// iptables -S leaves out a -d that matches everything.
				all := [2]string{"0.0.0.0/0", "::/0"}[i]
				if j := slices.Index(f, "-d"); j >= 0 && j+1 < len(f) {
					all = f[j+1]
				}
				fam[i] = append(fam[i], netip.MustParsePrefix(all))
			}
		}
	}
	if !masq[0] && !masq[1] {
		return "refused", string(logData)
	}
	return decision(fam[0], fam[1], masq[1]), string(logData)
}

// decision formats the no-masquerade prefixes of each family, sorted and
// deduplicated; v6 false: IPv6 not handled.
func decision(v4, v6 []netip.Prefix, ipv6 bool) string {
	format := func(ps []netip.Prefix) string {
		ps = sortCompact(slices.Clone(ps))
		s := make([]string, len(ps))
		for i, p := range ps {
			s[i] = p.String()
		}
		return strings.Join(s, " ")
	}
	out := "IPv4: " + format(v4)
	if ipv6 {
		out += "; IPv6: " + format(v6)
	}
	return out
}

// runIPMasq loads c's files and args in ipmasq's config cell (its flags
// parsed by the cells' own flag definitions; flags of other cells are
// ignored here) and returns its decision.
func runIPMasq(t *testing.T, c corpusCase) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "config")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, file := range c.files {
		data, err := os.ReadFile(filepath.Join(corpusDir, file))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := Config{IPMasqAgentConfigPath: filepath.Join(dir, "ip-masq-agent"), ResyncInterval: 60}
	st := settings.Default
	flags := pflag.NewFlagSet("ipmasq", pflag.ContinueOnError)
	flags.ParseErrorsAllowlist.UnknownFlags = true
	cfg.Flags(flags)
	st.Flags(flags)
	args := slices.Clone(c.args)
	if c.agent == "v2" {
		args = append(args, "--ip-masq-agent-v2")
	}
	if err := flags.Parse(args); err != nil {
		return "refused"
	}
	cfg.NoMasqAllReservedRanges, _ = flags.GetBool("nomasq-all-reserved-ranges")
	cfg.IPMasqAgentV2, _ = flags.GetBool("ip-masq-agent-v2")
	cfg.ResyncInterval, _ = flags.GetInt("resync-interval")
	st.EnableIPv6, _ = flags.GetBool("enable-ipv6")

	var (
		db     *statedb.DB
		cidrs  statedb.Table[*tables.NonMasqCIDR]
		status statedb.Table[*tables.ConfigStatus]
	)
	h := hive.New(statedb.Cell, job.Cell, cell.SimpleHealthCell, settings.Cell, Cell,
		cell.Invoke(func(d *statedb.DB, c statedb.Table[*tables.NonMasqCIDR], s statedb.Table[*tables.ConfigStatus]) {
			db, cidrs, status = d, c, s
		}))
	hive.AddConfigOverride(h, func(c *Config) { *c = cfg })
	hive.AddConfigOverride(h, func(c *settings.Config) { *c = st })
	log := hivetest.Logger(t, hivetest.LogLevel(4))
	if err := h.Start(log, context.Background()); err != nil {
		return "refused"
	}
	defer h.Stop(log, context.Background())
	deadline := time.Now().Add(5 * time.Second)
	for {
		txn := db.ReadTxn()
		var s *tables.ConfigStatus
		for row := range status.All(txn) {
			s = row
		}
		switch {
		case s != nil && s.Generation == 0 && s.LastError != "":
			return "refused"
		case s != nil && s.Generation > 0:
			var v4, v6 []netip.Prefix
			for row := range cidrs.All(txn) {
				if row.Action != tables.ActionNoMasquerade {
					continue
				}
				if row.Prefix.Addr().Is4() {
					v4 = append(v4, row.Prefix)
				} else {
					v6 = append(v6, row.Prefix)
				}
			}
			return decision(v4, v6, st.EnableIPv6)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: ipmasq's config cell settled on nothing in 5 s: %+v", c.id, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
