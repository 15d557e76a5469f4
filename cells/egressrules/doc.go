// Package iprules is the rules controller: it derives the ip-rules table
// from endpoints × nonmasq-cidrs, so that every endpoint with a route table
// gets "from <endpoint> to <prefix> lookup <table>" for each no-masquerade
// prefix of its family, and keeps them right on every config or endpoint
// change. It writes only the ip-rules table; the iprules reconciler writes
// the kernel.
//
// masqueradeCIDRs exceptions must win in the kernel too. Policy rules have
// no longest-prefix match, so nesting is expressed with priorities: a
// prefix nested in d other prefixes of the table gets priority
// --egress-rule-priority minus d. The deepest (longest) matching prefix
// therefore has the most preferred rule: an exception inside a
// no-masquerade range sends its traffic to the main table (where it is
// masqueraded), a no-masquerade range inside an exception goes back to the
// endpoint's table. Prefixes that decide the same as their parent get no
// rule of their own.
//
// While no endpoint has a route table, no rule can come of the config: the
// controller then neither derives the templates nor wakes for changes of
// nonmasq-cidrs, so a config change costs nothing outside the config →
// table → map path. The first endpoint with a route table brings them up
// to date in the same round. Nesting too deep for the priority range is
// reported (health degraded) while some endpoint has a route table.
package egressrules
