package egressrules

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"iter"
	"net/netip"
	"slices"

	"github.com/cilium/hive/cell"
	"github.com/cilium/statedb"
	"github.com/cilium/statedb/reconciler"

	"github.com/ipmasq/ipmasq/tables"
)

// controller keeps ip-rules derived from endpoints and nonmasq-cidrs, doing
// work in proportion to what changed: an endpoint change touches only that
// endpoint's rules, a config change only the rules of the templates that
// appeared or went away. Re-deriving endpoints × prefixes on every change
// is what made an agent with 16 384 prefixes and 1 000 endpoints run out of
// memory.
type controller struct {
	params          controllerParams
	markInitialized func(statedb.WriteTxn)

	// cidrRev is the nonmasq-cidrs revision the templates were derived
	// from; actions are that revision's rows in table order, to tell a
	// real config change from a status commit (which bumps the revision
	// too). A slice, not a map: a quarter of the memory at 16 384 prefixes
	// per family.
	cidrRev statedb.Revision
	actions []prefixAction
	v4, v6  []template
	errs    []error

	// withTable holds the endpoints that have a route table, with that
	// table: an endpoint's rules in ip-rules are exactly its table's rules
	// for the templates, so they are found by key, without an index of
	// the rules by endpoint (which cost 4 MB of live heap at 20 000
	// rules). While it is empty no rule can come of the templates, so the
	// controller neither derives them nor wakes for changes of
	// nonmasq-cidrs: a config change then costs nothing here. The first
	// endpoint with a route table brings the templates up to date.
	withTable map[netip.Addr]uint32

	// cidrRowsRead counts the nonmasq-cidrs rows read to tell a config
	// change from a status commit; tests check that it follows the rows
	// that changed, not the size of the table.
	cidrRowsRead int
}

func newController(p controllerParams, markInit func(statedb.WriteTxn)) *controller {
	return &controller{params: p, markInitialized: markInit, withTable: map[netip.Addr]uint32{}}
}

// run waits for both inputs to be initialized, then applies every change of
// either input to ip-rules.
func (c *controller) run(ctx context.Context, health cell.Health) error {
	p := c.params
	wtxn := p.DB.WriteTxn(p.Endpoints)
	epChanges, err := p.Endpoints.Changes(wtxn)
	wtxn.Commit()
	if err != nil {
		return fmt.Errorf("watch endpoint changes: %w", err)
	}
	defer epChanges.Close()
	if !c.waitInitialized(ctx) {
		return nil
	}
	for {
		txn := p.DB.ReadTxn()
		_, cidrsChanged := p.CIDRs.AllWatch(txn)
		changes, epsChanged := epChanges.Next(txn)
		added, deleted := c.step(txn, changes)
		if len(c.withTable) == 0 {
			// No endpoint can get a rule: config changes wait until
			// one with a route table arrives (an endpoint change).
			cidrsChanged = nil
		}
		if len(c.errs) > 0 && len(c.withTable) > 0 {
			health.Degraded("some prefixes get no ip rule", errors.Join(c.errs...))
		} else {
			health.OK(fmt.Sprintf("%d rule(s)", p.Rules.NumObjects(p.DB.ReadTxn())))
		}
		if added+deleted > 0 {
			p.Log.Debug("ip rules derived", "added", added, "deleted", deleted)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-cidrsChanged:
		case <-epsChanged:
		}
	}
}

// waitInitialized blocks until both inputs are initialized: deriving from a
// partial view would delete rules that are still wanted. It returns false
// when ctx ends first.
func (c *controller) waitInitialized(ctx context.Context) bool {
	p := c.params
	for {
		txn := p.DB.ReadTxn()
		cidrsInit, cidrsWatch := p.CIDRs.Initialized(txn)
		epsInit, epsWatch := p.Endpoints.Initialized(txn)
		if cidrsInit && epsInit {
			return true
		}
		// An initialized table's watch channel is closed: waiting on it
		// would spin.
		if cidrsInit {
			cidrsWatch = nil
		}
		if epsInit {
			epsWatch = nil
		}
		select {
		case <-ctx.Done():
			return false
		case <-cidrsWatch:
		case <-epsWatch:
		}
	}
}

// step brings ip-rules from the last derivation to the one of txn, given
// the endpoint changes since then.
func (c *controller) step(txn statedb.ReadTxn, changes iter.Seq2[statedb.Change[*tables.Endpoint], statedb.Revision]) (added, deleted int) {
	p := c.params
	// The rules in ip-rules follow the templates of the last step until
	// this one rewrites them.
	old4, old6 := c.v4, c.v6
	var gone4, new4, gone6, new6 []template
	if len(c.withTable) > 0 {
		gone4, new4, gone6, new6 = c.refreshTemplates(txn)
	}

	wtxn := p.DB.WriteTxn(p.Rules)
	templatesChanged := len(gone4)+len(new4)+len(gone6)+len(new6) > 0
	var synced map[netip.Addr]struct{} // only needed to apply template changes
	if templatesChanged {
		synced = map[netip.Addr]struct{}{}
	}
	for ch := range changes {
		ep := ch.Object
		if ch.Deleted {
			ep = &tables.Endpoint{IP: ch.Object.IP} // no route table: no rules
		}
		if ep.RouteTable != 0 && len(c.withTable) == 0 {
			// The first endpoint with a route table: the templates may
			// be behind the config. No endpoint had rules from them, so
			// what went away or appeared concerns no other endpoint.
			c.refreshTemplates(txn)
		}
		had := c.withTable[ep.IP]
		if ep.RouteTable != 0 {
			c.withTable[ep.IP] = ep.RouteTable
		} else {
			delete(c.withTable, ep.IP)
		}
		a, d := c.syncEndpoint(wtxn, ep, had, old4, old6)
		added, deleted = added+a, deleted+d
		if synced != nil {
			synced[ep.IP] = struct{}{}
		}
	}
	if templatesChanged {
		for ep := range p.Endpoints.All(txn) {
			if _, done := synced[ep.IP]; done || ep.RouteTable == 0 {
				continue
			}
			gone, fresh := gone4, new4
			if ep.Family() == tables.IPv6 {
				gone, fresh = gone6, new6
			}
			for _, t := range gone {
				if _, had, _ := p.Rules.Delete(wtxn, newRule(ep, t)); had {
					deleted++
				}
			}
			for _, t := range fresh {
				p.Rules.Insert(wtxn, newRule(ep, t))
				added++
			}
		}
	}
	if c.markInitialized != nil {
		c.markInitialized(wtxn)
		c.markInitialized = nil
	}
	wtxn.Commit()
	return added, deleted
}

// syncEndpoint makes ip-rules hold exactly ep's rules for the current
// templates, leaving rules that stay untouched (rewriting one would make
// the kernel reconciler write it again). hadTable is the endpoint's route
// table as of its last sync (0: it had no rules); its rules then came from
// the templates old4/old6 of the step's start, or the current ones if this
// step synced it already.
func (c *controller) syncEndpoint(wtxn statedb.WriteTxn, ep *tables.Endpoint, hadTable uint32, old4, old6 []template) (added, deleted int) {
	p := c.params
	cur, old := c.v4, old4
	if ep.Family() == tables.IPv6 {
		cur, old = c.v6, old6
	}
	var want []*tables.IPRule
	if ep.RouteTable != 0 {
		want = make([]*tables.IPRule, len(cur))
		for i, t := range cur {
			want[i] = newRule(ep, t)
		}
	}
	// An endpoint has a few rules per prefix of its family; an index of
	// them pays off only for large configs.
	var byKey map[tables.IPRuleKey]struct{}
	if len(want) > 16 {
		byKey = make(map[tables.IPRuleKey]struct{}, len(want))
		for _, r := range want {
			byKey[r.Key()] = struct{}{}
		}
	}
	wanted := func(k tables.IPRuleKey) bool {
		if byKey != nil {
			_, ok := byKey[k]
			return ok
		}
		return slices.ContainsFunc(want, func(r *tables.IPRule) bool { return r.Key() == k })
	}
	if hadTable != 0 {
		was := &tables.Endpoint{IP: ep.IP, RouteTable: hadTable}
		for _, ts := range [][]template{old, cur} {
			for _, t := range ts {
				r := newRule(was, t)
				if wanted(r.Key()) {
					continue
				}
				if _, had, _ := p.Rules.Delete(wtxn, r); had {
					deleted++
				}
			}
			if sameTemplates(old, cur) {
				break
			}
		}
	}
	for _, r := range want {
		if _, _, found := p.Rules.Get(wtxn, tables.IPRuleByKey.Query(r.Key())); found {
			continue // already there
		}
		p.Rules.Insert(wtxn, r)
		added++
	}
	return added, deleted
}

// sameTemplates reports whether a and b are the same slice: the templates
// did not change in this step.
func sameTemplates(a, b []template) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// refreshTemplates re-derives the templates when the prefixes or actions
// of nonmasq-cidrs changed and returns, per family, the templates that went
// away and the ones that appeared.
func (c *controller) refreshTemplates(txn statedb.ReadTxn) (gone4, new4, gone6, new6 []template) {
	p := c.params
	rev := p.CIDRs.Revision(txn)
	if rev == c.cidrRev {
		return
	}
	since := c.cidrRev
	c.cidrRev = rev
	if c.sameActions(txn, since) {
		return // a status commit, not a config change
	}
	rows := statedb.Collect(p.CIDRs.All(txn))
	actions := make([]prefixAction, len(rows))
	for i, r := range rows {
		actions[i] = prefixAction{r.Prefix, r.Action}
	}
	v4, v6, errs := templates(rows, p.Config.EgressRulePriority)
	gone4, new4 = diffTemplates(c.v4, v4)
	gone6, new6 = diffTemplates(c.v6, v6)
	c.actions, c.v4, c.v6, c.errs = actions, v4, v6, errs
	return gone4, new4, gone6, new6
}

// sameActions reports whether nonmasq-cidrs holds exactly the prefixes and
// actions of the last derivation, made at revision since. When few rows
// were written since (a status commit after one changed prefix is one
// row), it reads only those: a row not written since is unchanged, so with
// the same number of rows, every written row being one of the
// derivation's with the same action means the same set. When many were,
// one ordered walk of the table is cheaper than a search per row.
func (c *controller) sameActions(txn statedb.ReadTxn, since statedb.Revision) bool {
	p := c.params
	if p.CIDRs.NumObjects(txn) != len(c.actions) {
		return false
	}
	searches := len(c.actions)/32 + 16
	for r := range p.CIDRs.LowerBound(txn, statedb.ByRevision[*tables.NonMasqCIDR](since+1)) {
		if searches == 0 {
			return c.sameActionsWalk(txn)
		}
		searches--
		c.cidrRowsRead++
		i, found := slices.BinarySearchFunc(c.actions, r.Prefix, func(a prefixAction, q netip.Prefix) int {
			return compareTableOrder(a.prefix, q)
		})
		if !found || c.actions[i].action != r.Action {
			return false
		}
	}
	return true
}

// sameActionsWalk compares every row with the derivation's, both in table
// order.
func (c *controller) sameActionsWalk(txn statedb.ReadTxn) bool {
	i := 0
	for r := range c.params.CIDRs.All(txn) {
		c.cidrRowsRead++
		if c.actions[i] != (prefixAction{r.Prefix, r.Action}) {
			return false
		}
		i++
	}
	return true
}

// compareTableOrder orders prefixes as the nonmasq-cidrs primary index
// does (the 16-byte address, then the length), the order of actions. Rows
// hold masked prefixes (the loader masks them), as the index key does.
func compareTableOrder(p, q netip.Prefix) int {
	a, b := p.Addr().As16(), q.Addr().As16()
	if c := bytes.Compare(a[:], b[:]); c != 0 {
		return c
	}
	return cmp.Compare(p.Bits(), q.Bits())
}

type prefixAction struct {
	prefix netip.Prefix
	action tables.Action
}

// diffTemplates returns the templates of old missing from cur and those of
// cur missing from old. Both are in templates' order (by prefix, one
// template per prefix), so one merge pass does it without a map.
func diffTemplates(old, cur []template) (gone, fresh []template) {
	i, j := 0, 0
	for i < len(old) && j < len(cur) {
		switch c := comparePrefix(old[i].to, cur[j].to); {
		case c < 0:
			gone = append(gone, old[i])
			i++
		case c > 0:
			fresh = append(fresh, cur[j])
			j++
		default:
			if old[i] != cur[j] {
				gone, fresh = append(gone, old[i]), append(fresh, cur[j])
			}
			i, j = i+1, j+1
		}
	}
	gone = append(gone, old[i:]...)
	fresh = append(fresh, cur[j:]...)
	return gone, fresh
}

func hostPrefix(ip netip.Addr) netip.Prefix { return netip.PrefixFrom(ip, ip.BitLen()) }

// table is the route table ep's rule of this template looks up.
func (t template) table(ep *tables.Endpoint) uint32 {
	if t.main {
		return tables.MainRouteTable
	}
	return ep.RouteTable
}

func newRule(ep *tables.Endpoint, t template) *tables.IPRule {
	return &tables.IPRule{
		Priority: t.priority, From: hostPrefix(ep.IP), To: t.to, Table: t.table(ep),
		Status: reconciler.StatusPending(),
	}
}
