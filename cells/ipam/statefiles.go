package ipam

import "strings"

// IsStateFile reports whether name (a file name in --state-dir) is one the
// Store writes: the snapshot, its backup, the journal, their writes in
// progress (.tmp) and snapshots put aside as corrupt. `ipmasq-agent
// uninstall` removes these and nothing else, so a --state-dir shared with
// other files loses only ipmasq's.
func IsStateFile(name string) bool {
	for _, base := range []string{stateFile, stateFile + ".bak", journalFile} {
		if name == base || name == base+".tmp" {
			return true
		}
	}
	return strings.HasPrefix(name, stateFile+".corrupt-")
}
