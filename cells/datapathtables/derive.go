package datapathtables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// deriver keeps datapath-devices, masquerade-rule-sources and
// node-addresses in step with egress-devices and masquerade-rules.
type deriver struct {
	params          params
	markInitialized func(statedb.WriteTxn)
	// reported are the problems already logged, so each is logged once.
	reported map[string]bool
}

func (d *deriver) run(ctx context.Context, health cell.Health) error {
	p := d.params
	for {
		txn := p.DB.ReadTxn()
		devRows, devsChanged := p.Devices.AllWatch(txn)
		ruleRows, rulesChanged := p.Rules.AllWatch(txn)
		devsInit, devsInitWatch := p.Devices.Initialized(txn)
		rulesInit, rulesInitWatch := p.Rules.Initialized(txn)
		// An initialized table's watch channel is closed: waiting on it
		// would spin.
		if devsInit {
			devsInitWatch = nil
		}
		if rulesInit {
			rulesInitWatch = nil
		}
		if devsInit && rulesInit {
			devs := statedb.Collect(devRows)
			problems := d.sync(devs, statedb.Collect(ruleRows))
			d.logNew(problems)
			if len(problems) > 0 {
				health.Degraded("some masquerade rules are not in force", errors.Join(problems...))
			} else {
				health.OK(fmt.Sprintf("%d device(s)", len(devs)))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-devsChanged:
		case <-rulesChanged:
		case <-devsInitWatch:
		case <-rulesInitWatch:
		}
	}
}

// sync derives the datapath devices (selected devices with a SNAT address,
// and every device a masquerade rule names) and the rule sources on them.
// A rule whose toAddress is not an address of the node is left out and
// reported; the others keep working.
func (d *deriver) sync(devs []*tables.EgressDevice, rules []*tables.MasqueradeRule) (problems []error) {
	p := d.params
	local := map[netip.Addr]bool{}
	for _, dev := range devs {
		for _, a := range dev.Addresses {
			local[a] = true
		}
	}
	var usable []*tables.MasqueradeRule
	for _, r := range rules {
		if r.ToAddress.IsValid() && !local[r.ToAddress] {
			problems = append(problems, fmt.Errorf("masquerade rule %q: toAddress %s is not an address of this node", r.Name, r.ToAddress))
			continue
		}
		usable = append(usable, r)
	}
	slices.SortFunc(usable, func(a, b *tables.MasqueradeRule) int { return compareStrings(a.Name, b.Name) })

	wantDevs := map[int]*tables.DatapathDevice{}
	wantSrcs := map[tables.MasqueradeRuleSourceKey]*tables.MasqueradeRuleSource{}
	for _, dev := range devs {
		if dev.Loopback {
			continue // its addresses are node addresses; nothing leaves through it
		}
		var matched []*tables.MasqueradeRule
		for _, r := range usable {
			if r.MatchesDevice(dev.Name) {
				matched = append(matched, r)
			}
		}
		if !dev.Selected && len(matched) == 0 {
			continue
		}
		if !dev.Ethernet && !dev.L3 {
			p.Log.Warn("Device has a link-layer header that is neither Ethernet nor absent (e.g. GRE without a remote); the datapath does not attach to it", "device", dev.Name)
			continue
		}
		row := &tables.DatapathDevice{Index: dev.Index, Name: dev.Name, L3: dev.L3}
		if p.Agent.EnableIPv4 {
			row.SNATv4 = dev.SNATv4
		}
		if p.Agent.EnableIPv6 {
			row.SNATv6 = dev.SNATv6
		}
		if len(matched) == 0 && !row.SNATv4.IsValid() && !row.SNATv6.IsValid() {
			continue // selected, but nothing to translate to
		}
		wantDevs[dev.Index] = row
		for _, r := range matched {
			for _, src := range r.Sources {
				if (src.Addr().Is4() && !p.Agent.EnableIPv4) || (src.Addr().Is6() && !p.Agent.EnableIPv6) {
					continue
				}
				k := tables.MasqueradeRuleSourceKey{Ifindex: dev.Index, Source: src}
				if prev, ok := wantSrcs[k]; ok {
					if prev.ToAddress != r.ToAddress {
						problems = append(problems, fmt.Errorf("masquerade rules %q and %q both masquerade %s on %s to different addresses; %q wins",
							prev.Rule, r.Name, src, dev.Name, prev.Rule))
					}
					continue
				}
				wantSrcs[k] = &tables.MasqueradeRuleSource{Ifindex: dev.Index, Device: dev.Name, Source: src, ToAddress: r.ToAddress, Rule: r.Name}
			}
		}
	}

	wtxn := p.DB.WriteTxn(p.DPDevices, p.RuleSources, p.NodeAddrs)
	syncNodeAddresses(wtxn, p.NodeAddrs, local)
	for row := range p.DPDevices.All(wtxn) {
		if w, ok := wantDevs[row.Index]; ok && w.SameAs(row) {
			delete(wantDevs, row.Index)
		} else if !ok {
			p.DPDevices.Delete(wtxn, row)
		}
	}
	for _, row := range wantDevs {
		row.Status = reconciler.StatusPending()
		p.DPDevices.Insert(wtxn, row)
	}
	for row := range p.RuleSources.All(wtxn) {
		k := tables.MasqueradeRuleSourceKey{Ifindex: row.Ifindex, Source: row.Source}
		if w, ok := wantSrcs[k]; ok && w.ToAddress == row.ToAddress && w.Rule == row.Rule && w.Device == row.Device {
			delete(wantSrcs, k)
		} else if !ok {
			p.RuleSources.Delete(wtxn, row)
		}
	}
	for _, row := range wantSrcs {
		row.Status = reconciler.StatusPending()
		p.RuleSources.Insert(wtxn, row)
	}
	if d.markInitialized != nil {
		d.markInitialized(wtxn)
		d.markInitialized = nil
	}
	wtxn.Commit()
	return problems
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// logNew logs the problems not logged before.
func (d *deriver) logNew(problems []error) {
	now := map[string]bool{}
	for _, p := range problems {
		now[p.Error()] = true
		if !d.reported[p.Error()] {
			d.params.Log.Warn("Masquerade rule not in force", "problem", p.Error())
		}
	}
	d.reported = now
}

// syncNodeAddresses makes node-addresses hold every address of every
// device, loopback included: such destinations are the node itself and are
// never masqueraded, and NAT pairs translated to them live on (the
// collector ends the pairs of addresses the node no longer has).
func syncNodeAddresses(wtxn statedb.WriteTxn, tbl statedb.RWTable[*tables.NodeAddress], want map[netip.Addr]bool) {
	keep := make(map[netip.Addr]bool, len(want))
	for row := range tbl.All(wtxn) {
		if want[row.Addr] {
			keep[row.Addr] = true
		} else {
			tbl.Delete(wtxn, row)
		}
	}
	for a := range want {
		if !keep[a] {
			tbl.Insert(wtxn, &tables.NodeAddress{Addr: a, Status: reconciler.StatusPending()})
		}
	}
}
