package config

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

func mustParse(t *testing.T, path, content string) namedFile {
	t.Helper()
	p, err := parse(path, []byte(content), limBoth)
	if err != nil {
		t.Fatal(err)
	}
	return namedFile{path: path, p: p}
}

// TestMerge: several files merge as ip-masq-agent-v2 merges them, and each
// disagreement is a warning that names the files and what was done.
func TestMerge(t *testing.T) {
	a := mustParse(t, "a", `
nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]
masqueradeCIDRs: [10.96.0.0/12, 192.168.1.0/24]
masqLinkLocal: false
resyncInterval: 60s
foo: 1
masqueradeRules:
- {name: wg, sources: [10.8.0.0/24], outInterfaces: [eth0]}
- {name: same, sources: [10.9.0.0/24], outInterfaces: [eth0]}
`)
	b := mustParse(t, "b", `
nonMasqueradeCIDRs: [10.244.0.0/16, 10.0.0.0/8, 192.168.1.0/24]
masqLinkLocal: true
masqLinkLocalIPv6: false
resyncInterval: 30s
masqueradeRules:
- {name: wg, sources: [10.8.1.0/24], outInterfaces: [eth0]}
- {name: same, sources: [10.9.0.0/24], outInterfaces: [eth0]}
`)
	c := mustParse(t, "c", "") // adds nothing
	f, entries, warnings, err := merge([]namedFile{a, b, c}, limBoth)
	if err != nil {
		t.Fatal(err)
	}
	if want := pfx("10.0.0.0/8", "10.244.0.0/16", "192.168.0.0/16", "192.168.1.0/24"); !slices.Equal(f.NonMasqueradeCIDRs, want) {
		t.Errorf("nonMasqueradeCIDRs %v, want the union %v", f.NonMasqueradeCIDRs, want)
	}
	if want := pfx("10.96.0.0/12"); !slices.Equal(f.MasqueradeCIDRs, want) {
		t.Errorf("masqueradeCIDRs %v, want %v (192.168.1.0/24 is b's nonMasqueradeCIDRs)", f.MasqueradeCIDRs, want)
	}
	if !f.MasqLinkLocal || f.MasqLinkLocalIPv6 {
		t.Errorf("masqLinkLocal %v, masqLinkLocalIPv6 %v: want true (b says so), false", f.MasqLinkLocal, f.MasqLinkLocalIPv6)
	}
	if f.ResyncInterval != 30*time.Second {
		t.Errorf("resyncInterval %v, want the shortest", f.ResyncInterval)
	}
	if len(f.MasqueradeRules) != 2 || f.MasqueradeRules[0].Sources[0] != pfx("10.8.0.0/24")[0] {
		t.Errorf("rules %+v, want a's wg and one same", f.MasqueradeRules)
	}
	if !slices.Equal(entries, f.Entries(limBoth)) {
		t.Error("entries are not the merged file's")
	}
	var got []string
	for _, w := range warnings {
		got = append(got, string(w.Kind)+": "+w.Message)
	}
	for _, want := range []string{
		`unknown-key: a: unknown key "foo" ignored`,
		"conflict: a: masqueradeCIDRs lists 192.168.1.0/24, which b lists in nonMasqueradeCIDRs; it is not masqueraded",
		"conflict: masqLinkLocal: true in b, false in a; 169.254.0.0/16 is masqueraded",
		"conflict: resyncInterval: 1m0s in a, 30s in b; the shortest, 30s, is used",
		`conflict: b: masqueradeRules: rule "wg" differs from the rule of that name in a; the rule of a is used`,
	} {
		if !slices.ContainsFunc(got, func(g string) bool { return strings.HasPrefix(g, want) }) {
			t.Errorf("no warning %q in\n%s", want, strings.Join(got, "\n"))
		}
	}
	if len(got) != 5 {
		t.Errorf("%d warnings, want 5 (same rule twice and masqLinkLocalIPv6 false alone are none):\n%s", len(got), strings.Join(got, "\n"))
	}
}

// TestMergeNoKey: as in v2, files without nonMasqueradeCIDRs add nothing;
// the defaults are for no file at all.
func TestMergeNoKey(t *testing.T) {
	f, _, warnings, err := merge([]namedFile{mustParse(t, "a", "masqLinkLocal: true\n"), mustParse(t, "b", "")}, limBoth)
	if err != nil || len(warnings) != 0 {
		t.Fatal(err, warnings)
	}
	if !f.NonMasqueradeCIDRsSet || len(f.NonMasqueradeCIDRs) != 0 {
		t.Errorf("nonMasqueradeCIDRs %v (set %v), want an empty list", f.NonMasqueradeCIDRs, f.NonMasqueradeCIDRsSet)
	}
	for _, e := range f.Entries(limBoth) {
		if e.Origin == tables.OriginDefault {
			t.Errorf("default row %v", e)
		}
	}
}

// TestMergeCapacity: the merged rows are checked against the map capacity,
// naming the files.
func TestMergeCapacity(t *testing.T) {
	lim := Limits{EnableIPv4: true, MaxCIDRsPerFamily: 3}
	a, _ := parse("a", []byte("nonMasqueradeCIDRs: [10.0.0.0/8]\n"), lim)
	b, _ := parse("b", []byte("nonMasqueradeCIDRs: [11.0.0.0/8, 12.0.0.0/8]\n"), lim)
	_, _, _, err := merge([]namedFile{{"a", a}, {"b", b}}, lim)
	if err == nil || !strings.HasPrefix(err.Error(), "a + b: 4 IPv4 prefixes") {
		t.Fatalf("error %v, want the capacity exceeded naming a + b", err)
	}
}

func TestIsDropIn(t *testing.T) {
	for name, want := range map[string]bool{
		"ip-masq-agent-reconciled": true, "ip-masq-custom": true, "ip-masq": true, "ip-masq-agent-reconciled.yaml": true,
		"ip-masq-agent": false, "ip-masq-agent.tmp": false, "ip-masq-agent.yaml": false, "ip-masq-x~": false,
		"ip-masq-x.swp": false, ".ip-masq-x": false, "..data": false, "config": false, "IP-MASQ-x": false,
	} {
		if got := isDropIn(name, "ip-masq-agent"); got != want {
			t.Errorf("isDropIn(%q) = %v, want %v", name, got, want)
		}
	}
}

// TestMergeCarriesEveryKey: a file that sets every key, merged beside a
// file that sets none of them, keeps each one in the merged File, so a key
// added to File (docs/layout.md, "A new config key") without its rule in
// merge is not silently dropped as soon as a second ip-masq* file appears.
func TestMergeCarriesEveryKey(t *testing.T) {
	// Fields merge does not carry on purpose.
	notMerged := map[string]string{
		"CIDRLimit":   "each file's own, checked when that file is parsed",
		"UnknownKeys": "warnings of each file (unknownKeyWarnings)",
	}
	all := mustParse(t, "a", `
nonMasqueradeCIDRs: [10.0.0.0/8]
masqueradeCIDRs: [10.96.0.0/12]
masqLinkLocal: true
masqLinkLocalIPv6: true
resyncInterval: 30s
cidrLimit: 10
typo: 1
masqueradeRules:
- {name: wg, sources: [192.168.6.0/24], outInterfaces: [eth0]}
`)
	other := mustParse(t, "b", "nonMasqueradeCIDRs: [172.16.0.0/12]\n")
	f, _, _, err := merge([]namedFile{all, other}, limBoth)
	if err != nil {
		t.Fatal(err)
	}
	in, out := reflect.ValueOf(*all.p.file), reflect.ValueOf(*f)
	for i := range in.NumField() {
		name := in.Type().Field(i).Name
		if in.Field(i).IsZero() {
			t.Errorf("File.%s: the test's file does not set it; give it a value above", name)
			continue
		}
		if _, skip := notMerged[name]; !skip && out.Field(i).IsZero() {
			t.Errorf("File.%s is set in one of the merged files but not in the merge: add its rule to merge (merge.go)", name)
		}
	}
}

// TestV2Decisions: with Limits.V2, files are read as ip-masq-agent-v2
// reads them (cmd/ip-masq-agent-v2/ip-masq-agent.go at 45758a6: syncConfig
// starts from EmptyMasqConfig and merges every ip-masq* file; the defaults
// only when no file was added; cidrLimit is no field of its MasqConfig).
func TestV2Decisions(t *testing.T) {
	v1 := Limits{EnableIPv4: true, EnableIPv6: true}
	v2 := v1
	v2.V2 = true
	entries := func(lim Limits, contents ...string) []string {
		t.Helper()
		var files []namedFile
		for i, c := range contents {
			p, err := parse(string(rune('a'+i)), []byte(c), lim)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, namedFile{path: string(rune('a' + i)), p: p})
		}
		_, es, _, err := merge(files, lim)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range es {
			out = append(out, e.Prefix.String())
		}
		return out
	}
	for _, tc := range []struct {
		name     string
		lim      Limits
		contents []string
		want     string
	}{
		{"v1: a lone file without the key gets the defaults", v1, []string{"masqLinkLocalIPv6: true\n"}, "10.0.0.0/8 169.254.0.0/16 172.16.0.0/12 192.168.0.0/16"},
		{"v2: a lone file without the key lists none", v2, []string{"masqLinkLocalIPv6: true\n"}, "169.254.0.0/16"},
		{"v1: zero bytes is no file", v1, []string{""}, "10.0.0.0/8 169.254.0.0/16 172.16.0.0/12 192.168.0.0/16 fe80::/10"},
		{"v2: zero bytes lists none", v2, []string{""}, "169.254.0.0/16 fe80::/10"},
		{"v2: no file, the defaults", v2, nil, "10.0.0.0/8 169.254.0.0/16 172.16.0.0/12 192.168.0.0/16 fe80::/10"},
		{"v2: union, link-local ORed", v2, []string{"nonMasqueradeCIDRs: [10.0.0.0/8]\n", "nonMasqueradeCIDRs: [1.0.0.0/8]\nmasqLinkLocal: true\n"}, "1.0.0.0/8 10.0.0.0/8 fe80::/10"},
		{"v2: cidrLimit ignored", v2, []string{"cidrLimit: 0\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"}, "10.0.0.0/8 169.254.0.0/16 fe80::/10"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.contents == nil {
				if got := strings.Join(prefixStrings((*File)(nil).Entries(tc.lim)), " "); got != tc.want {
					t.Fatalf("got %s, want %s", got, tc.want)
				}
				return
			}
			if got := strings.Join(entries(tc.lim, tc.contents...), " "); got != tc.want {
				t.Fatalf("got %s, want %s", got, tc.want)
			}
		})
	}
}

func prefixStrings(es []Entry) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Prefix.String())
	}
	return out
}
