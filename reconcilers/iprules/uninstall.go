package iprules

import (
	"errors"
	"fmt"
)

// RemoveOwned deletes every rule of both families that carries Protocol
// and has the form this package writes (see Target.List), at any
// priority: an earlier agent may have run with another
// --egress-rule-priority. It is `ipmasq-agent uninstall`'s step, for the
// network namespace of the calling thread, with no agent running; report
// is called once per rule deleted.
func RemoveOwned(report func(string)) error {
	t := NewNetlinkTarget(nil)
	rules, err := t.List()
	if err != nil {
		return err
	}
	var errs []error
	for _, k := range rules {
		if err := t.Del(k); err != nil {
			errs = append(errs, err)
			continue
		}
		report(fmt.Sprintf("removed ip rule %q (protocol %d)", k.String(), Protocol))
	}
	return errors.Join(errs...)
}
