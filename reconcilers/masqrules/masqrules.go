package masqrules

import (
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/bpfmap"
	"github.com/ipmasq/ipmasq/tables"
)

// masqRuleOps writes masquerade-rule-sources into masq_rules_v4/v6, each
// row to the map of its family.
func masqRuleOps(dp *bpf.Datapath) (reconciler.Operations[*tables.MasqueradeRuleSource], error) {
	m4, err := bpfmap.NewMap[bpf.MasqRuleKeyV4, bpf.MasqRule](dp.Maps.MasqRulesV4)
	if err != nil {
		return nil, err
	}
	m6, err := bpfmap.NewMap[bpf.MasqRuleKeyV6, bpf.MasqRule](dp.Maps.MasqRulesV6)
	if err != nil {
		return nil, err
	}
	return &bpfmap.ByFamily[*tables.MasqueradeRuleSource]{
		V4: bpfmap.NewOps(m4, func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV4, bpf.MasqRule) {
			return bpf.MasqRuleKeyV4From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
		}),
		V6: bpfmap.NewOps(m6, func(s *tables.MasqueradeRuleSource) (bpf.MasqRuleKeyV6, bpf.MasqRule) {
			return bpf.MasqRuleKeyV6From(s.Ifindex, s.Source), bpf.MasqRuleTo(s.ToAddress)
		}),
		Is4:  func(s *tables.MasqueradeRuleSource) bool { return s.Source.Addr().Is4() },
		Name: func(s *tables.MasqueradeRuleSource) string { return s.Source.String() + " on " + s.Device },
	}, nil
}
