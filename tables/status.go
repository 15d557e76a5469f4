package tables

import "github.com/cilium/statedb/reconciler"

// StatusString shows a reconciliation status without its age, so that
// tables compare stably in script tests.
func StatusString(s reconciler.Status) string {
	if s.Kind == reconciler.StatusKindError {
		return "Error: " + s.GetError()
	}
	return s.Kind.String()
}
