package main

import (
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/ipmasq/ipmasq/uninstall"
)

// newUninstallCommand takes ipmasq off the node (package uninstall). It
// takes the agent's path flags, with the same defaults and IPMASQ_*
// variables, so that the Job passes what the DaemonSet passes.
func newUninstallCommand() *cobra.Command {
	o := uninstall.DefaultOptions
	o.BPFRoot = envOr("IPMASQ_BPF_ROOT", o.BPFRoot)
	o.StateDir = envOr("IPMASQ_STATE_DIR", o.StateDir)
	o.APISocket = envOr("IPMASQ_API_SOCKET", o.APISocket)
	o.ShellSocket = envOr("IPMASQ_SHELL_SOCK_PATH", o.ShellSocket)
	if p, err := strconv.ParseUint(envOr("IPMASQ_EGRESS_RULE_PRIORITY", ""), 10, 32); err == nil {
		o.RulePriority = uint32(p)
	}
	cmd := &cobra.Command{
		Use:   "uninstall",
		Short: "Remove ipmasq from this node: detach the programs, remove the pins, the ip rules of protocol 170, the state and the sockets",
		Long: `Removes ipmasq from this node (its network namespace and the paths given):
the tc programs (pinned tcx links under <bpf-root>/ipmasq/links, and ipmasq's
clsact filters on every device), every pin under <bpf-root>/ipmasq, the ip rules
of protocol 170 (both families, every priority), the state files in --state-dir
and the agent's sockets. One line per object removed, then a count; a second
run removes nothing and says so. Refused (exit 1) while an agent runs.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if _, err := uninstall.Run(o, cmd.OutOrStdout()); err != nil {
				return fmt.Errorf("uninstall: %w", err)
			}
			return nil
		},
	}
	o.Flags(cmd.Flags())
	return cmd
}
