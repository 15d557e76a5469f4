package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/uninstall"
)

// newUninstallCommand takes ipmasq off the node (package uninstall). It
// takes the agent's path flags, with the same defaults and IPMASQ_*
// variables, so that the Job passes what the DaemonSet passes.
func newUninstallCommand() *cobra.Command {
	o := uninstall.DefaultOptions
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
	}
	o.Flags(cmd.Flags())
	// IPMASQ_<FLAG> variables, as for the agent: set before the command
	// line is parsed, so that a flag given there wins.
	var envErrs []error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		name := envName(f.Name)
		if v, ok := os.LookupEnv(name); ok {
			if err := f.Value.Set(v); err != nil {
				envErrs = append(envErrs, fmt.Errorf("%s=%q: %w", name, v, err))
			}
		}
	})
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if err := errors.Join(envErrs...); err != nil {
			return err
		}
		if _, err := uninstall.Run(o, cmd.OutOrStdout()); err != nil {
			return fmt.Errorf("uninstall: %w", err)
		}
		return nil
	}
	return cmd
}

// envName is the variable that sets a flag: IPMASQ_STATE_DIR for
// --state-dir.
func envName(flag string) string {
	return agent.EnvPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}
