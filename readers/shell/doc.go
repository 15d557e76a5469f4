// Package shell serves the agent's operator shell on --shell-sock-path
// (mode 0600): "ipmasq-agent shell" and "ipmasq-agent status" talk to it
// with the client of github.com/cilium/hive/shell, over the same wire
// protocol.
//
// Unlike hive's shell.ServerCell, which serves every script command of the
// hive plus exec and cat, this shell is read-only: it offers the commands
// of an explicit allow-list (the db/* queries, health, the agent's own read
// commands and two operator actions that are safe by design) and refuses
// everything else with one line that names the command and says why:
//
//	$ ipmasq-agent shell 'exec id'
//	error: exec: not available in the agent's read-only shell; it runs programs as the agent (root with NET_ADMIN, BPF and PERFMON) (help lists what the shell offers)
//
// A command a cell registers later is refused until it is added to the
// allow-list; a test fails while a registered command is neither allowed nor
// explicitly refused. Script tests build their own engine from the hive's
// commands and keep all of them. docs/security.md explains the threat model.
package shell
