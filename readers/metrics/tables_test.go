package metrics

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/cilium/statedb"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/ipmasq/ipmasq/tables"
)

func TestRowCollector(t *testing.T) {
	db := statedb.New()
	endpoints, err := tables.NewEndpointTable(db)
	if err != nil {
		t.Fatal(err)
	}
	rules, err := tables.NewIPRuleTable(db)
	if err != nil {
		t.Fatal(err)
	}
	// Tables that are absent from the hive have no metric.
	c := newRowCollector(sources{DB: db, Endpoints: endpoints, IPRules: rules})

	wtxn := db.WriteTxn(endpoints, rules)
	ep := netip.MustParseAddr("10.244.1.2")
	endpoints.Insert(wtxn, &tables.Endpoint{IP: ep, Owner: "c0ffee/eth0", RouteTable: 11})
	endpoints.Insert(wtxn, &tables.Endpoint{IP: netip.MustParseAddr("fd00::2"), Owner: "c0ffee/eth0"})
	for _, to := range []string{"10.0.0.0/8", "169.254.0.0/16"} {
		rules.Insert(wtxn, &tables.IPRule{Priority: 111, From: netip.PrefixFrom(ep, 32), To: netip.MustParsePrefix(to), Table: 11})
	}
	wtxn.Commit()

	want := `
# HELP ipmasq_endpoints Endpoint addresses allocated by IPAM (table endpoints).
# TYPE ipmasq_endpoints gauge
ipmasq_endpoints 2
# HELP ipmasq_ip_rules Desired per-endpoint ip rules (table ip-rules).
# TYPE ipmasq_ip_rules gauge
ipmasq_ip_rules 2
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
	if newRowCollector(sources{DB: db}) != nil {
		t.Fatal("a row collector without tables")
	}
}
