package config

import (
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ipmasq/ipmasq/tables"
)

const testPath = "/etc/config/ip-masq-agent"

var (
	limBoth = Limits{EnableIPv4: true, EnableIPv6: true, MaxCIDRsPerFamily: 16384}
	limV4   = Limits{EnableIPv4: true, MaxCIDRsPerFamily: 16384}
	limV6   = Limits{EnableIPv6: true, MaxCIDRsPerFamily: 16384}
)

func pfx(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(ss))
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func TestParseValid(t *testing.T) {
	tests := []struct {
		name string
		in   string
		lim  Limits
		want *File
	}{
		{"zero bytes", "", limBoth, &File{}},
		{"whitespace only", " \n\t\r\n ", limBoth, &File{}},
		{"comments only", "# nothing here\n  # at all\n", limBoth, &File{}},
		{"document marker only", "---\n", limBoth, &File{}},
		{"document marker and comment", "---\n# c\n", limBoth, &File{}},
		{"empty JSON object", "{}", limBoth, &File{}},
		{"empty JSON object with spaces", "  \n{ }\n", limBoth, &File{}},
		{"UTF-8 BOM", "\xef\xbb\xbfmasqLinkLocal: true\n", limBoth, &File{MasqLinkLocal: true}},
		{
			"kubernetes example YAML",
			"nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 192.168.0.0/16\nmasqLinkLocal: true\nresyncInterval: 60s\n",
			limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8", "192.168.0.0/16"), NonMasqueradeCIDRsSet: true,
				MasqLinkLocal: true, ResyncInterval: time.Minute},
		},
		{
			"kubernetes example JSON",
			`{"nonMasqueradeCIDRs": ["192.168.0.0/16", "10.0.0.0/8"], "masqLinkLocal": false, "resyncInterval": "1m30s"}`,
			limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8", "192.168.0.0/16"), NonMasqueradeCIDRsSet: true,
				ResyncInterval: 90 * time.Second},
		},
		{
			"YAML flow mapping starting with brace",
			"{nonMasqueradeCIDRs: [10.0.0.0/8], masqLinkLocalIPv6: true}",
			limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8"), NonMasqueradeCIDRsSet: true, MasqLinkLocalIPv6: true},
		},
		{"empty list", "nonMasqueradeCIDRs: []\n", limBoth,
			&File{NonMasqueradeCIDRs: []netip.Prefix{}, NonMasqueradeCIDRsSet: true}},
		{"empty list JSON", `{"nonMasqueradeCIDRs": []}`, limBoth,
			&File{NonMasqueradeCIDRs: []netip.Prefix{}, NonMasqueradeCIDRsSet: true}},
		{"YAML null is an empty list", "nonMasqueradeCIDRs:\n#  - 10.0.0.0/8\n", limBoth,
			&File{NonMasqueradeCIDRs: []netip.Prefix{}, NonMasqueradeCIDRsSet: true}},
		{"JSON null is an empty list", `{"nonMasqueradeCIDRs": null}`, limBoth,
			&File{NonMasqueradeCIDRs: []netip.Prefix{}, NonMasqueradeCIDRsSet: true}},
		{
			"duplicates are removed and lists sorted",
			"nonMasqueradeCIDRs: [fd00::/8, 10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/16, 0.0.0.0/0, FD00::/8]\nmasqueradeCIDRs: [10.1.0.0/16, 10.1.0.0/16]\n",
			limBoth,
			&File{NonMasqueradeCIDRs: pfx("0.0.0.0/0", "10.0.0.0/8", "10.0.0.0/16", "fd00::/8"), NonMasqueradeCIDRsSet: true,
				MasqueradeCIDRs: pfx("10.1.0.0/16")},
		},
		{
			"IPv6 block list, ::/0 unquoted",
			"nonMasqueradeCIDRs:\n- fd00::/8\n- ::/0\nmasqueradeCIDRs:\n- \"2001:db8::/32\"\n",
			limV6,
			&File{NonMasqueradeCIDRs: pfx("::/0", "fd00::/8"), NonMasqueradeCIDRsSet: true, MasqueradeCIDRs: pfx("2001:db8::/32")},
		},
		{"masqueradeCIDRs only", "masqueradeCIDRs: [10.1.0.0/16]\n", limV4, &File{MasqueradeCIDRs: pfx("10.1.0.0/16")}},
		{"cidrLimit within bound", "cidrLimit: 3\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]\nmasqueradeCIDRs: [10.1.0.0/16]\n", limV4,
			&File{CIDRLimit: 3, NonMasqueradeCIDRs: pfx("10.0.0.0/8"), NonMasqueradeCIDRsSet: true, MasqueradeCIDRs: pfx("10.1.0.0/16")}},
		{"YAML 1.1 yes is true", "masqLinkLocal: yes\n", limBoth, &File{MasqLinkLocal: true}},
		{
			"masquerade rules",
			`masqueradeRules:
- name: wg-clients
  sources: [10.8.0.0/24, 10.9.0.0/24, 10.8.0.0/24]
  outInterfaces: [eth0, ens+, eth0]
  toAddress: 192.0.2.10
- name: v6.vpn_1
  sources: ["fd10::/64"]
  outInterfaces: [wg0]
`,
			limBoth,
			&File{MasqueradeRules: []tables.MasqueradeRule{
				{Name: "wg-clients", Sources: pfx("10.8.0.0/24", "10.9.0.0/24"), OutInterfaces: []string{"eth0", "ens+"},
					ToAddress: netip.MustParseAddr("192.0.2.10")},
				{Name: "v6.vpn_1", Sources: pfx("fd10::/64"), OutInterfaces: []string{"wg0"}},
			}},
		},
		{
			"masquerade rules JSON",
			`{"masqueradeRules": [{"name": "a", "sources": ["fd00::/64"], "outInterfaces": ["veth12345678901+"], "toAddress": "fd00::1"}]}`,
			limV6,
			&File{MasqueradeRules: []tables.MasqueradeRule{{Name: "a", Sources: pfx("fd00::/64"),
				OutInterfaces: []string{"veth12345678901+"}, ToAddress: netip.MustParseAddr("fd00::1")}}},
		},
		{"15-byte interface name", `{"masqueradeRules": [{"name": "a", "sources": ["10.0.0.0/8"], "outInterfaces": ["abcdefghijklmno"]}]}`, limV4,
			&File{MasqueradeRules: []tables.MasqueradeRule{{Name: "a", Sources: pfx("10.0.0.0/8"), OutInterfaces: []string{"abcdefghijklmno"}}}}},
		{"capacity exactly reached", "nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\n", Limits{EnableIPv4: true, MaxCIDRsPerFamily: 3},
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8", "10.1.0.0/16"), NonMasqueradeCIDRsSet: true}},
		{"link-local listed explicitly is not counted twice", "nonMasqueradeCIDRs: [10.0.0.0/8, 169.254.0.0/16]\n", Limits{EnableIPv4: true, MaxCIDRsPerFamily: 2},
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8", "169.254.0.0/16"), NonMasqueradeCIDRsSet: true}},
		{"no capacity bound when 0", "nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\n", Limits{EnableIPv4: true},
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8", "10.1.0.0/16"), NonMasqueradeCIDRsSet: true}},
		{"keys match case-insensitively as in the Kubernetes agent", "MasqLinkLocal: true\n", limBoth, &File{MasqLinkLocal: true}},
		// Unknown keys are ignored, as the Kubernetes agent ignores them;
		// the known keys apply.
		{"unknown key YAML", "resyncIntervall: 60s\nnonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n", limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8"), NonMasqueradeCIDRsSet: true, MasqLinkLocal: true, UnknownKeys: []string{"resyncIntervall"}}},
		{"misspelt list key: the defaults apply", "nonMasqueradeCIDR: [10.0.0.0/8]\n", limBoth,
			&File{UnknownKeys: []string{"nonMasqueradeCIDR"}}},
		{"unknown keys JSON", `{"zeta": 1, "nonMasqueradeCIDRs": ["10.0.0.0/8"], "alpha": {"x": [1, null]}, "resyncInterval": "30s"}`, limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8"), NonMasqueradeCIDRsSet: true, ResyncInterval: 30 * time.Second,
				UnknownKeys: []string{"alpha", "zeta"}}},
		{"unknown key YAML flow mapping", "{nonMasqueradeCIDRs: [10.0.0.0/8], foo: bar}", limBoth,
			&File{NonMasqueradeCIDRs: pfx("10.0.0.0/8"), NonMasqueradeCIDRsSet: true, UnknownKeys: []string{"foo"}}},
		{"unknown key beside a rule", "foo: 1\nmasqueradeRules:\n- name: a\n  sources: [10.8.0.0/24]\n  outInterfaces: [eth0]\n", limBoth,
			&File{MasqueradeRules: []tables.MasqueradeRule{{Name: "a", Sources: pfx("10.8.0.0/24"), OutInterfaces: []string{"eth0"}}},
				UnknownKeys: []string{"foo"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(testPath, []byte(tt.in), tt.lim)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("Parse:\n got  %+v\n want %+v", got, tt.want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	rule := func(body string) string {
		return "masqueradeRules:\n- name: wg-clients\n" + body
	}
	tests := []struct {
		name string
		in   string
		lim  Limits
		want string // the whole message, after "<path>: "
		sub  bool   // want is only a substring
	}{
		// syntax and keys
		// An unknown top-level key is ignored (TestParse), not the values
		// of the known keys beside it, nor an unknown key in a rule.
		{"unknown key beside a bad value YAML", "resyncIntervall: 60s\nnonMasqueradeCIDRs: [10.0.0.1/8]\n", limBoth,
			"nonMasqueradeCIDRs[0]: 10.0.0.1/8 has host bits set; did you mean 10.0.0.0/8?", false},
		{"unknown key before a wrong type JSON", `{"foo": 1, "masqLinkLocal": "yes"}`, limBoth,
			"masqLinkLocal: got a string, want true or false (near line 1, column 33)", false},
		{"unknown key after a wrong type YAML", "masqLinkLocal: \"yes\"\nfoo: 1\n", limBoth,
			"masqLinkLocal: got a string, want true or false", false},
		{"unknown key beside resyncInterval without unit", "resyncIntervall: 1\nresyncInterval: 60\n", limBoth,
			`resyncInterval: got a number, want a duration string such as 60s`, false},
		{"unknown key in a rule", rule("  sources: [10.0.0.0/8]\n  outInterface: [eth0]\n"), limBoth,
			`unknown field "outInterface" (did you mean outInterfaces?`, true},
		{"unknown key in a rule beside an unknown top-level key", "foo: 1\n" + rule("  sources: [10.0.0.0/8]\n  outInterface: [eth0]\n"), limBoth,
			`unknown field "outInterface" (did you mean outInterfaces?`, true},
		{"unknown key in a JSON rule beside an unknown top-level key",
			`{"foo": 1, "masqueradeRules": [{"name": "a", "sources": ["10.0.0.0/8"], "outInterfaces": ["eth0"], "toAdress": "10.0.0.1"}]}`, limBoth,
			`unknown field "toAdress" (did you mean toAddress?`, true},
		{"invalid YAML", "nonMasqueradeCIDRs: [10.0.0.0/8\n", limBoth, `invalid YAML: line 1: did not find expected ',' or ']'`, false},
		{"invalid JSON", "{\n  \"masqLinkLocal\": true\n  \"masqLinkLocalIPv6\": true\n}", limBoth,
			"invalid JSON at line 3, column 3: invalid character '\"' after object key:value pair", false},
		{"truncated JSON", `{"nonMasqueradeCIDRs": ["10.0.0.0/8"`, limBoth,
			"invalid JSON: the file ends before the top-level object is closed (truncated?)", false},
		{"trailing JSON", `{"nonMasqueradeCIDRs": []} {}`, limBoth,
			"invalid JSON at line 1, column 28: unexpected data after the top-level object", false},
		{"top level list", "- 10.0.0.0/8\n", limBoth, "the file must be a mapping with keys such as", true},
		{"wrong type bool YAML", "masqLinkLocal: \"yes\"\n", limBoth, "masqLinkLocal: got a string, want true or false", false},
		{"wrong type bool JSON", `{"masqLinkLocal": "yes"}`, limBoth, "masqLinkLocal: got a string, want true or false (near line 1, column 23)", false},
		{"wrong type list", "nonMasqueradeCIDRs: 10.0.0.0/8\n", limBoth, "nonMasqueradeCIDRs: got a string, want a list", false},
		{"wrong type list item JSON", `{"nonMasqueradeCIDRs": [10]}`, limBoth,
			"nonMasqueradeCIDRs: got a number, want a CIDR string such as 10.0.0.0/8 (near line 1, column 26)", false},
		{"wrong type rule", "masqueradeRules: [wg]\n", limBoth,
			"masqueradeRules: got a string, want a mapping with keys name, sources, outInterfaces, toAddress", false},
		{"wrong type cidrLimit", "cidrLimit: 1.5\n", limBoth, "cidrLimit: got number 1.5, want a whole number greater than 0", false},

		// CIDRs
		{"not a CIDR", "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16, 10.0.0/8]\n", limBoth,
			`nonMasqueradeCIDRs[2]: "10.0.0/8" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8)`, false},
		{"bare address", "masqueradeCIDRs: [10.0.0.1]\n", limBoth,
			`masqueradeCIDRs[0]: "10.0.0.1" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8); for a single address write 10.0.0.1/32`, false},
		{"padded value", `{"nonMasqueradeCIDRs": [" 10.0.0.0/8"]}`, limBoth,
			`nonMasqueradeCIDRs[0]: " 10.0.0.0/8" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8); remove the surrounding whitespace`, false},
		{"zone", `{"nonMasqueradeCIDRs": ["fe80::%eth0/64"]}`, limBoth,
			`nonMasqueradeCIDRs[0]: "fe80::%eth0/64" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8); IPv6 zones (%name) are not allowed in a CIDR`, false},
		{"prefix length too long", "nonMasqueradeCIDRs: [10.0.0.0/33]\n", limBoth,
			`nonMasqueradeCIDRs[0]: "10.0.0.0/33" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8); the prefix length must be 0-32 for IPv4`, false},
		{"empty string", `{"masqueradeCIDRs": [""]}`, limBoth,
			`masqueradeCIDRs[0]: "" is not a CIDR (want e.g. 10.0.0.0/8 or fd00::/8)`, false},
		{"host bits", "nonMasqueradeCIDRs: [10.0.0.1/8]\n", limBoth,
			"nonMasqueradeCIDRs[0]: 10.0.0.1/8 has host bits set; did you mean 10.0.0.0/8?", false},
		{"host bits IPv6", "masqueradeCIDRs: [\"fd00::1/8\"]\n", limBoth,
			"masqueradeCIDRs[0]: fd00::1/8 has host bits set; did you mean fd00::/8?", false},
		{"IPv4-mapped", `{"nonMasqueradeCIDRs": ["::ffff:10.0.0.0/104"]}`, limBoth,
			"nonMasqueradeCIDRs[0]: ::ffff:10.0.0.0/104 is an IPv4-mapped IPv6 prefix; write it in IPv4 form: 10.0.0.0/8", false},
		{"IPv4-mapped whole range", `{"nonMasqueradeCIDRs": ["::ffff:0:0/96"]}`, limBoth,
			"nonMasqueradeCIDRs[0]: ::ffff:0:0/96 is an IPv4-mapped IPv6 prefix; write it in IPv4 form: 0.0.0.0/0", false},
		{"IPv6 disabled", "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\n", limV4,
			"nonMasqueradeCIDRs[1]: fd00::/8 is IPv6 but IPv6 is disabled (--enable-ipv6=false)", false},
		{"IPv4 disabled", "masqueradeCIDRs: [10.0.0.0/8]\n", limV6,
			"masqueradeCIDRs[0]: 10.0.0.0/8 is IPv4 but IPv4 is disabled (--enable-ipv4=false)", false},
		{"in both lists", "nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16, 10.2.0.0/16]\nmasqueradeCIDRs: [10.3.0.0/16, 10.2.0.0/16]\n", limBoth,
			"10.2.0.0/16 is listed in both nonMasqueradeCIDRs[2] and masqueradeCIDRs[1]; a destination is either masqueraded or not, remove one", false},

		// other keys
		{"resyncInterval without unit", "resyncInterval: 60\n", limBoth,
			`resyncInterval: got a number, want a duration string such as 60s`, false},
		{"resyncInterval without unit JSON", `{"resyncInterval": "60"}`, limBoth,
			`resyncInterval: "60" is not a duration (want e.g. 60s or 1m30s)`, false},
		{"resyncInterval empty", `{"resyncInterval": ""}`, limBoth,
			`resyncInterval: "" is not a duration (want e.g. 60s or 1m30s)`, false},
		{"cidrLimit negative", "cidrLimit: -3\n", limBoth, "cidrLimit: -3 is below 0, so not even an empty list fits (the Kubernetes agent refuses it too); leave cidrLimit out for no limit", false},
		{"cidrLimit zero with a CIDR", "cidrLimit: 0\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", limBoth,
			"nonMasqueradeCIDRs and masqueradeCIDRs list 1 CIDRs, which exceeds cidrLimit 0 (raise cidrLimit or remove entries)", false},
		{"cidrLimit exceeded", "cidrLimit: 2\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\nmasqueradeCIDRs: [10.2.0.0/16]\n", limBoth,
			"nonMasqueradeCIDRs and masqueradeCIDRs list 3 CIDRs, which exceeds cidrLimit 2 (raise cidrLimit or remove entries)", false},

		// capacity
		{"capacity IPv4 with link-local", "nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\nmasqueradeCIDRs: [10.0.1.0/24]\n",
			Limits{EnableIPv4: true, MaxCIDRsPerFamily: 3},
			"4 IPv4 prefixes (nonMasqueradeCIDRs, masqueradeCIDRs and link-local) exceed the map capacity of 3 (--max-nonmasq-cidrs)", false},
		{"capacity IPv6", "nonMasqueradeCIDRs: [fd00::/8, fd01::/16]\nmasqLinkLocal: true\n",
			Limits{EnableIPv4: true, EnableIPv6: true, MaxCIDRsPerFamily: 2},
			"3 IPv6 prefixes (nonMasqueradeCIDRs, masqueradeCIDRs and link-local) exceed the map capacity of 2 (--max-nonmasq-cidrs)", false},
		{"capacity with defaults", "masqueradeCIDRs: [10.1.0.0/16, 10.0.0.0/8]\n",
			Limits{EnableIPv4: true, MaxCIDRsPerFamily: 4},
			"5 IPv4 prefixes (reserved defaults, masqueradeCIDRs and link-local) exceed the map capacity of 4 (--max-nonmasq-cidrs)", false},
		{"capacity with all reserved ranges", "masqueradeCIDRs: [10.1.0.0/16, 10.0.0.0/8]\n",
			Limits{EnableIPv4: true, MaxCIDRsPerFamily: 12, AllReservedRanges: true},
			"13 IPv4 prefixes (reserved defaults, masqueradeCIDRs and link-local) exceed the map capacity of 12 (--max-nonmasq-cidrs)", false},

		// masqueradeRules
		{"rule without name", "masqueradeRules:\n- sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n", limBoth,
			"masqueradeRules[0]: name is required (letters, digits, '.', '_' and '-', at most 63 characters)", false},
		{"rule name bad character", "masqueradeRules:\n- name: wg clients\n", limBoth,
			`masqueradeRules[0]: name "wg clients" contains " "; only letters, digits, '.', '_' and '-' are allowed`, false},
		{"rule name too long", "masqueradeRules:\n- name: " + strings.Repeat("a", 64) + "\n", limBoth,
			`is 64 characters long; at most 63 are allowed`, true},
		{"rule duplicate name", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n- name: x\n  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n- name: wg-clients\n"), limBoth,
			`masqueradeRules[2] (wg-clients): name "wg-clients" is already used by masqueradeRules[0]; rule names must be unique`, false},
		{"rule without sources", rule("  outInterfaces: [eth0]\n"), limBoth,
			"masqueradeRules[0] (wg-clients): sources is required: list at least one source CIDR, e.g. [10.8.0.0/24]", false},
		{"rule bad source", rule("  sources: [10.0.0.0/8, 10.8.0.1/24]\n  outInterfaces: [eth0]\n"), limBoth,
			"masqueradeRules[0] (wg-clients): sources[1]: 10.8.0.1/24 has host bits set; did you mean 10.8.0.0/24?", false},
		{"rule source of disabled family", rule("  sources: [fd00::/64]\n  outInterfaces: [eth0]\n"), limV4,
			"masqueradeRules[0] (wg-clients): sources[0]: fd00::/64 is IPv6 but IPv6 is disabled (--enable-ipv6=false)", false},
		{"rule without outInterfaces", rule("  sources: [10.0.0.0/8]\n"), limBoth,
			"masqueradeRules[0] (wg-clients): outInterfaces is required: list at least one device name or prefix pattern, e.g. [eth0] or [eth+]", false},
		{"interface with slash", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0, eth/1]\n"), limBoth,
			`masqueradeRules[0] (wg-clients): outInterfaces[1]: interface name "eth/1" contains "/", which Linux does not allow in device names`, false},
		{"interface with colon", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [\"eth0:1\"]\n"), limBoth,
			`outInterfaces[0]: interface name "eth0:1" contains ":", which Linux does not allow in device names`, true},
		{"interface with space", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [\"eth 0\"]\n"), limBoth,
			`outInterfaces[0]: interface name "eth 0" contains whitespace or a control character`, true},
		{"interface too long", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [abcdefghijklmnop]\n"), limBoth,
			`outInterfaces[0]: interface name "abcdefghijklmnop" is longer than 15 bytes, the Linux limit`, true},
		{"interface dot", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [..]\n"), limBoth,
			`outInterfaces[0]: ".." is not a valid interface name`, true},
		{"interface empty", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [\"\"]\n"), limBoth,
			`outInterfaces[0]: empty interface name`, true},
		{"pattern without prefix", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [\"+\"]\n"), limBoth,
			`outInterfaces[0]: "+": a pattern needs a name prefix before '+', e.g. eth+`, true},
		{"plus in the middle", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [\"eth+0\"]\n"), limBoth,
			`outInterfaces[0]: interface name "eth+0": '+' is only allowed at the end, as a prefix pattern (e.g. eth+)`, true},
		{"toAddress invalid", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: 10.0.0\n"), limBoth,
			`masqueradeRules[0] (wg-clients): toAddress: "10.0.0" is not an IP address (want e.g. 10.0.0.5 or fd00::5)`, false},
		{"toAddress unspecified", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: 0.0.0.0\n"), limBoth,
			`toAddress: 0.0.0.0 is the unspecified address; leave toAddress out to use the device's address`, true},
		{"toAddress mapped", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: \"::ffff:10.0.0.5\"\n"), limBoth,
			`toAddress: ::ffff:10.0.0.5 is an IPv4-mapped IPv6 address; write it in IPv4 form: 10.0.0.5`, true},
		{"toAddress multicast", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: 224.0.0.1\n"), limBoth,
			`toAddress: 224.0.0.1 is not a unicast address`, true},
		{"toAddress loopback", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: 127.0.0.1\n"), limBoth,
			`toAddress: 127.0.0.1 is a loopback address, which cannot leave the node`, true},
		{"toAddress zone", rule("  sources: [fe80::/64]\n  outInterfaces: [eth0]\n  toAddress: \"fe80::1%eth0\"\n"), limBoth,
			`toAddress: fe80::1%eth0 has a zone; write the address without %eth0`, true},
		{"toAddress family mismatch", rule("  sources: [10.8.0.0/24, fd00::/64]\n  outInterfaces: [eth0]\n  toAddress: 10.0.0.5\n"), limBoth,
			"masqueradeRules[0] (wg-clients): toAddress 10.0.0.5 is IPv4 but source fd00::/64 is IPv6; use one rule per family", false},
		{"toAddress family disabled", rule("  sources: [10.0.0.0/8]\n  outInterfaces: [eth0]\n  toAddress: fd00::5\n"), limV4,
			"masqueradeRules[0] (wg-clients): toAddress: fd00::5 is IPv6 but IPv6 is disabled (--enable-ipv6=false)", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := Parse(testPath, []byte(tt.in), tt.lim)
			if err == nil {
				t.Fatalf("Parse succeeded with %+v, want error %q", f, tt.want)
			}
			if f != nil {
				t.Errorf("Parse returned a File along with error %v", err)
			}
			msg := err.Error()
			rest, ok := strings.CutPrefix(msg, testPath+": ")
			if !ok {
				t.Fatalf("error %q does not start with the file name", msg)
			}
			if strings.Contains(msg, "\n") {
				t.Errorf("error %q spans several lines", msg)
			}
			if tt.sub {
				if !strings.Contains(rest, tt.want) {
					t.Fatalf("error\n %q\ndoes not contain\n %q", msg, tt.want)
				}
			} else if rest != tt.want {
				t.Fatalf("error\n got  %q\n want %q", rest, tt.want)
			}
		})
	}
}

// TestParseEmptyPath checks that an empty path still yields a named error.
func TestParseEmptyPath(t *testing.T) {
	_, err := Parse("", []byte("masqLinkLocal: 1"), limBoth)
	if err == nil || !strings.HasPrefix(err.Error(), "<config>: ") {
		t.Fatalf("got %v", err)
	}
}

func entries(specs ...string) []Entry {
	// spec: "<prefix> <m|n> <c|d|l>"
	var out []Entry
	for _, s := range specs {
		f := strings.Fields(s)
		e := Entry{Prefix: netip.MustParsePrefix(f[0])}
		if f[1] == "m" {
			e.Action = tables.ActionMasquerade
		}
		switch f[2] {
		case "d":
			e.Origin = tables.OriginDefault
		case "l":
			e.Origin = tables.OriginLinkLocal
		}
		out = append(out, e)
	}
	return out
}

// defaultEntries are the Kubernetes agent's defaults: RFC 1918 and link-local.
var defaultEntries = []string{"10.0.0.0/8 n d", "169.254.0.0/16 n l", "172.16.0.0/12 n d", "192.168.0.0/16 n d"}

// reservedEntries are the defaults with --nomasq-all-reserved-ranges.
var reservedEntries = []string{
	"10.0.0.0/8 n d", "100.64.0.0/10 n d", "169.254.0.0/16 n l", "172.16.0.0/12 n d",
	"192.0.0.0/24 n d", "192.0.2.0/24 n d", "192.88.99.0/24 n d", "192.168.0.0/16 n d",
	"198.18.0.0/15 n d", "198.51.100.0/24 n d", "203.0.113.0/24 n d", "240.0.0.0/4 n d",
}

func TestEntries(t *testing.T) {
	tests := []struct {
		name string
		in   *string // nil: f == nil
		lim  Limits
		want []Entry
	}{
		{"no file IPv4", nil, limV4, entries(defaultEntries...)},
		{"no file dual stack", nil, limBoth, entries(append(slices.Clone(defaultEntries), "fe80::/10 n l")...)},
		{"no file IPv6 only", nil, limV6, entries("fe80::/10 n l")},
		{"no file, all reserved ranges", nil, Limits{EnableIPv4: true, AllReservedRanges: true}, entries(reservedEntries...)},
		{"no nonMasqueradeCIDRs key, all reserved ranges", ptr("masqLinkLocalIPv6: true\n"), Limits{EnableIPv4: true, EnableIPv6: true, AllReservedRanges: true},
			entries(reservedEntries...)},
		// As in the Kubernetes agent, the flag changes only the defaults:
		// a listed (even empty) nonMasqueradeCIDRs replaces them.
		{"empty list, all reserved ranges: link-local only", ptr("nonMasqueradeCIDRs: []\n"), Limits{EnableIPv4: true, AllReservedRanges: true},
			entries("169.254.0.0/16 n l")},
		{"no family", nil, Limits{}, []Entry{}},
		{"empty file is the same as no file", ptr(""), limBoth, entries(append(slices.Clone(defaultEntries), "fe80::/10 n l")...)},
		{"masqLinkLocal", ptr("masqLinkLocal: true\nmasqLinkLocalIPv6: true\n"), limBoth,
			entries(slices.DeleteFunc(slices.Clone(defaultEntries), func(s string) bool { return strings.HasPrefix(s, "169.254") })...)},
		{"empty list: link-local only", ptr("nonMasqueradeCIDRs: []\n"), limBoth, entries("169.254.0.0/16 n l", "fe80::/10 n l")},
		{"null list: link-local only", ptr("nonMasqueradeCIDRs:\n"), limV4, entries("169.254.0.0/16 n l")},
		{"explicit link-local keeps config origin", ptr("nonMasqueradeCIDRs: [169.254.0.0/16, fe80::/10, 10.0.0.0/8]\n"), limBoth,
			entries("10.0.0.0/8 n c", "169.254.0.0/16 n c", "fe80::/10 n c")},
		{"masquerade exceptions sorted in", ptr("nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\nmasqueradeCIDRs: [10.1.0.0/16, 10.0.0.0/16, fd00:1::/32]\nmasqLinkLocal: true\n"), limBoth,
			entries("10.0.0.0/8 n c", "10.0.0.0/16 m c", "10.1.0.0/16 m c", "fd00::/8 n c", "fd00:1::/32 m c", "fe80::/10 n l")},
		{"masqueradeCIDRs override a default", ptr("masqueradeCIDRs: [10.0.0.0/8, 169.254.0.0/16]\n"), limV4,
			entries(append(slices.DeleteFunc(slices.Clone(defaultEntries), func(s string) bool {
				return strings.HasPrefix(s, "10.0.0.0/8") || strings.HasPrefix(s, "169.254")
			}), "10.0.0.0/8 m c", "169.254.0.0/16 m c")...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var f *File
			if tt.in != nil {
				var err error
				if f, err = Parse(testPath, []byte(*tt.in), tt.lim); err != nil {
					t.Fatal(err)
				}
			}
			got := f.Entries(tt.lim)
			want := slices.Clone(tt.want)
			slices.SortFunc(want, func(a, b Entry) int { return a.Prefix.Compare(b.Prefix) })
			if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
				t.Fatalf("Entries:\n got  %v\n want %v", got, want)
			}
			checkEntries(t, f, tt.lim, got)
		})
	}
}

func ptr[T any](v T) *T { return &v }

// TestEntriesHandBuilt checks that Entries copes with a File that did not
// come from Parse: duplicates, unmasked and invalid prefixes, families
// the limits disable.
func TestEntriesHandBuilt(t *testing.T) {
	f := &File{
		NonMasqueradeCIDRsSet: true,
		NonMasqueradeCIDRs:    append(pfx("10.0.0.1/8", "10.0.0.0/8", "fd00::/8"), netip.Prefix{}),
		MasqueradeCIDRs:       pfx("10.0.0.0/8"),
		MasqLinkLocal:         true,
	}
	got := f.Entries(limV4)
	want := entries("10.0.0.0/8 m c")
	if !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

// checkEntries asserts the invariants of Entries and that familyCounts,
// which Parse uses for the capacity check, agrees with it.
func checkEntries(t testing.TB, f *File, lim Limits, es []Entry) {
	t.Helper()
	var v4, v6 int
	for i, e := range es {
		if e.Prefix != e.Prefix.Masked() || !e.Prefix.IsValid() {
			t.Fatalf("entry %v is not a masked valid prefix", e)
		}
		if i > 0 && es[i-1].Prefix.Compare(e.Prefix) >= 0 {
			t.Fatalf("entries not sorted or duplicated at %d: %v then %v", i, es[i-1], e)
		}
		if e.Prefix.Addr().Is4() {
			v4++
			if !lim.EnableIPv4 {
				t.Fatalf("IPv4 entry %v with IPv4 disabled", e)
			}
		} else {
			v6++
			if !lim.EnableIPv6 {
				t.Fatalf("IPv6 entry %v with IPv6 disabled", e)
			}
		}
	}
	if lim.MaxCIDRsPerFamily > 0 && (v4 > lim.MaxCIDRsPerFamily || v6 > lim.MaxCIDRsPerFamily) {
		t.Fatalf("%d IPv4 / %d IPv6 entries exceed %d", v4, v6, lim.MaxCIDRsPerFamily)
	}
	if f == nil {
		f = &File{}
	}
	if c4, c6 := familyCounts(f, lim); c4 != v4 || c6 != v6 {
		t.Fatalf("familyCounts = %d/%d, Entries has %d/%d", c4, c6, v4, v6)
	}
}

func genCIDRs(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%d.%d.%d.0/24", 11+i>>16, i>>8&0xff, i&0xff)
	}
	return out
}

// TestParseFullMap parses a file that fills a 16 384-entry map exactly.
func TestParseFullMap(t *testing.T) {
	cidrs := genCIDRs(16383) // + link-local
	in := "nonMasqueradeCIDRs:\n- " + strings.Join(cidrs, "\n- ") + "\n"
	f, err := Parse(testPath, []byte(in), limV4)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(f.Entries(limV4)); n != 16384 {
		t.Fatalf("%d entries", n)
	}
	in += "- 9.0.0.0/8\n"
	_, err = Parse(testPath, []byte(in), limV4)
	want := testPath + ": 16385 IPv4 prefixes (nonMasqueradeCIDRs, masqueradeCIDRs and link-local) exceed the map capacity of 16384 (--max-nonmasq-cidrs)"
	if err == nil || err.Error() != want {
		t.Fatalf("got %v, want %s", err, want)
	}
}

func TestJSONDuplicateKey(t *testing.T) {
	tests := []struct {
		in   string
		want string
	}{
		{`{}`, ""},
		{`{"a": 1, "b": {"a": 2}, "c": [{"a": 1}, {"a": 2}]}`, ""},
		{`{"a": "a", "b": ["a", "a"]}`, ""},
		{`{"a": 1, "a": 2}`, "a"},
		{`{"x": [{"n": 1, "n": 2}]}`, "n"},
		{`{"a\"b": 1, "a\u0022b": 2}`, `a"b`},
		{`{"k": "\\", "k2": "}", "k": 3}`, "k"},
	}
	for _, tt := range tests {
		got, ok := jsonDuplicateKey([]byte(tt.in))
		if got != tt.want || ok != (tt.want != "") {
			t.Errorf("jsonDuplicateKey(%s) = %q, %v; want %q", tt.in, got, ok, tt.want)
		}
	}
}

func BenchmarkParse(b *testing.B) {
	const n = 16384
	cidrs := genCIDRs(n)
	inputs := []struct {
		name string
		data []byte
	}{
		{"JSON", []byte(`{"masqLinkLocal": true, "nonMasqueradeCIDRs": ["` + strings.Join(cidrs, `", "`) + `"]}`)},
		{"YAML", []byte("masqLinkLocal: true\nnonMasqueradeCIDRs:\n- " + strings.Join(cidrs, "\n- ") + "\n")},
	}
	for _, in := range inputs {
		b.Run(fmt.Sprintf("%s/%d", in.name, n), func(b *testing.B) {
			b.SetBytes(int64(len(in.data)))
			b.ReportAllocs()
			for b.Loop() {
				f, err := Parse(testPath, in.data, limV4)
				if err != nil {
					b.Fatal(err)
				}
				if len(f.NonMasqueradeCIDRs) != n {
					b.Fatalf("%d CIDRs", len(f.NonMasqueradeCIDRs))
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns/cidr")
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/op")
		})
	}
	b.Run(fmt.Sprintf("Entries/%d", n), func(b *testing.B) {
		f, err := Parse(testPath, inputs[0].data, limV4)
		if err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			_ = f.Entries(limV4)
		}
	})
}

// TestYAMLAliasBomb checks that a "billion laughs" document is refused quickly.
func TestYAMLAliasBomb(t *testing.T) {
	in := `a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
nonMasqueradeCIDRs: [*h,*h,*h,*h,*h,*h,*h,*h,*h]
`
	start := time.Now()
	_, err := Parse(testPath, []byte(in), limBoth)
	if err == nil || !strings.Contains(err.Error(), "excessive aliasing") {
		t.Fatalf("got %v, want an excessive aliasing error", err)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("took %v", d)
	}
}

// TestKeysComeFromRawFile: the keys error messages list and suggest are
// rawFile's and rawRule's tags, in the order operators read them in the
// README.
func TestKeysComeFromRawFile(t *testing.T) {
	if want := "nonMasqueradeCIDRs, masqueradeCIDRs, masqLinkLocal, masqLinkLocalIPv6, resyncInterval, cidrLimit, masqueradeRules"; topLevelKeys != want {
		t.Errorf("topLevelKeys = %q, want %q", topLevelKeys, want)
	}
	if want := "name, sources, outInterfaces, toAddress"; ruleKeys != want {
		t.Errorf("ruleKeys = %q, want %q", ruleKeys, want)
	}
	if got := closestKey("outInterface"); got != "outInterfaces" {
		t.Errorf("closestKey(outInterface) = %q", got)
	}
}

// TestUpstreamAcceptsOddFiles: files the Kubernetes agent accepts are
// applied as it reads them, each with one warning (kind odd) that names
// the file and what was read; the rest of the file applies.
func TestUpstreamAcceptsOddFiles(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		lim      Limits
		want     *File
		warning  string // a substring of the one warning
	}{
		{"duplicate key YAML, the last wins", "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\nnonMasqueradeCIDRs: [192.168.0.0/16]\n", limBoth,
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx("192.168.0.0/16"), MasqLinkLocal: true},
			`line 3: key "nonMasqueradeCIDRs" already set in map; the last value is used`},
		{"duplicate key JSON, the last wins", `{"masqLinkLocal": true, "masqLinkLocal": false, "nonMasqueradeCIDRs": []}`, limBoth,
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx()},
			`key "masqLinkLocal" is set more than once in one object; the last value is used`},
		{"duplicate key in a JSON rule, the last wins", `{"masqueradeRules": [{"name": "a", "name": "b", "sources": ["10.8.0.0/24"], "outInterfaces": ["eth0"]}]}`, limBoth,
			&File{MasqueradeRules: []tables.MasqueradeRule{{Name: "b", Sources: pfx("10.8.0.0/24"), OutInterfaces: []string{"eth0"}}}},
			`key "name" is set more than once in one object`},
		{"second YAML document ignored", "masqLinkLocal: true\n---\nmasqLinkLocalIPv6: true\n", limBoth,
			&File{MasqLinkLocal: true}, "line 2: a second YAML document starts here and is ignored"},
		{"empty first document", "---\n---\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", limBoth,
			&File{}, "line 2: a second YAML document starts here and is ignored"},
		{"resyncInterval zero", "resyncInterval: 0s\nnonMasqueradeCIDRs: []\n", limBoth,
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx()}, `resyncInterval: "0s" is not above 0; the Kubernetes agent then re-reads the file without pause, ipmasq re-reads it every --resync-interval (1m0s unless set`},
		{"resyncInterval negative", "resyncInterval: -5s\n", limBoth, &File{}, `resyncInterval: "-5s" is not above 0`},
		{"resyncInterval below a second", `{"resyncInterval": "1ns"}`, limBoth, &File{ResyncInterval: time.Second}, `resyncInterval: "1ns" is below 1s; ipmasq re-reads the file every 1s`},
		{"cidrLimit zero, empty list", "cidrLimit: 0\nnonMasqueradeCIDRs: []\n", limBoth,
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx()}, "cidrLimit: 0 allows no CIDR in nonMasqueradeCIDRs"},
		{"cidrLimit ignored in v2", "cidrLimit: 0\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", Limits{EnableIPv4: true, V2: true},
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx("10.0.0.0/8")}, "cidrLimit: ignored, as ip-masq-agent-v2 ignores it"},
		{"YAML flow mapping", "{nonMasqueradeCIDRs: [10.0.0.0/8]}", limBoth,
			&File{NonMasqueradeCIDRsSet: true, NonMasqueradeCIDRs: pfx("10.0.0.0/8")}, "not JSON but a YAML flow mapping"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := parse(testPath, []byte(tc.in), tc.lim)
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			got := *p.file
			if got.MasqueradeCIDRs == nil {
				got.MasqueradeCIDRs = nil
			}
			if !reflect.DeepEqual(&got, tc.want) {
				t.Errorf("got  %+v\nwant %+v", &got, tc.want)
			}
			var odd []string
			for _, w := range p.warnings {
				if w.Kind == tables.ConfigWarningOdd {
					odd = append(odd, w.Message)
				}
			}
			if len(odd) == 0 || !strings.HasPrefix(odd[0], testPath+": ") || !strings.Contains(odd[0], tc.warning) || len(odd) > 2 {
				t.Errorf("warnings %q, want one naming the file and containing %q", odd, tc.warning)
			}
		})
	}
}
