package netfilter

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/cilium/statedb"

	"github.com/ipmasq/ipmasq/tables"
)

// TestOneLinePerChange: a set of rules is warned about once, however many
// scans find it again; a changed set warns again; none left says so once.
func TestOneLinePerChange(t *testing.T) {
	db := statedb.New()
	tbl, err := tables.NewNetfilterNATRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	var log bytes.Buffer
	w := &watcher{params: params{Log: slog.New(slog.NewTextHandler(&log, nil)), DB: db, Rules: tbl}}
	chain := &tables.NetfilterNATRule{Family: "ip", Table: "nat", Chain: "IP-MASQ-AGENT", Kind: tables.NetfilterIPMasqAgentChain}
	masq := &tables.NetfilterNATRule{Family: "ip", Table: "nat", Chain: "IP-MASQ-AGENT", Handle: 7, Kind: tables.NetfilterMasquerade, Sources: "any"}
	snat := &tables.NetfilterNATRule{Family: "ip6", Table: "nat", Chain: "POSTROUTING", Handle: 3, Kind: tables.NetfilterSNAT, Sources: "fd00:244::/64"}

	for _, step := range []struct {
		rows     []*tables.NetfilterNATRule
		wantLine string // "" : nothing logged
	}{
		{nil, ""},
		{[]*tables.NetfilterNATRule{chain, masq}, `level=WARN msg="Netfilter NAT rules decide before ipmasq`},
		{[]*tables.NetfilterNATRule{masq, chain}, ""},
		{[]*tables.NetfilterNATRule{chain, masq, snat}, "ip6 nat POSTROUTING handle 3: snat from fd00:244::/64"},
		{nil, `level=INFO msg="No netfilter NAT rule decides before ipmasq any more"`},
		{nil, ""},
	} {
		log.Reset()
		w.write(step.rows)
		lines := strings.Split(strings.TrimSpace(log.String()), "\n")
		switch {
		case step.wantLine == "" && log.Len() != 0:
			t.Errorf("%d rules: logged %q, want nothing", len(step.rows), log.String())
		case step.wantLine != "" && (len(lines) != 1 || !strings.Contains(lines[0], step.wantLine)):
			t.Errorf("%d rules: logged %q, want one line with %q", len(step.rows), log.String(), step.wantLine)
		}
		if got := tbl.NumObjects(db.ReadTxn()); got != len(step.rows) {
			t.Errorf("table holds %d rows, want %d", got, len(step.rows))
		}
	}
}
