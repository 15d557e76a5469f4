// Package handover moves established flows between Linux conntrack and the
// datapath's NAT pairs, so that a node migrating from a netfilter
// MASQUERADE agent (the Kubernetes ip-masq-agent) to ipmasq, or back,
// keeps every connection (docs/migrate.md).
//
// While a netfilter NAT rule decides before ipmasq (the netfilter-nat-rules
// table is not empty), the job handover:
//
//   - adopts conntrack's masquerade bindings of forwarded sources: each
//     becomes a NAT pair with the same translated port (bpf.AdoptV4/V6),
//     read once from a dump and then from conntrack's NEW events, so that
//     the pair is there when the rule goes and, once conntrack loses the
//     flow (conntrack keeps translating it after the rule goes, until its
//     entry expires or is deleted), the flow's next packet, now
//     untranslated by netfilter, finds it;
//   - hands its own pairs back to conntrack: the pair is marked and
//     conntrack's untranslated entry of the flow replaced by one with the
//     pair's translation (one ctnetlink delete and create, sent together),
//     so that netfilter translates the flow once ipmasq is gone.
//
// A pair either way is marked as conntrack's: the ingress program leaves its
// replies to conntrack while conntrack has the flow (lib/handover.h). With
// no rule deciding before ipmasq, nothing runs.
package handover
