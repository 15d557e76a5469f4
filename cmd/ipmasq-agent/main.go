// Command ipmasq-agent is the ipmasq node agent: it reads the ip-masq-agent
// config, keeps it in StateDB tables and writes the BPF maps the masquerade
// datapath consults.
//
//	ipmasq-agent --ip-masq-agent-config-path=/etc/config/ip-masq-agent
//	ipmasq-agent hive        # print the cell graph
//	ipmasq-agent maps        # print the pinned maps
//	ipmasq-agent nat         # list the NAT pairs (like conntrack -L; --summary like conntrack -S)
//	ipmasq-agent status      # summary of the running agent (over its shell socket)
//	ipmasq-agent shell       # the agent's shell: db/show, maps/dump, datapath/nat, ...
//	ipmasq-agent uninstall   # remove ipmasq from the node (no agent running)
//	ipmasq-agent --version   # the build's version
//	ipmasq-agent --help      # every flag; each can also be set as IPMASQ_<FLAG>
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/cilium/ebpf/rlimit"
	"github.com/cilium/hive"
	hiveshell "github.com/cilium/hive/shell"
	"github.com/spf13/cobra"

	"github.com/ipmasq/ipmasq/agent"
	"github.com/ipmasq/ipmasq/bpf"
	"github.com/ipmasq/ipmasq/internal/buildinfo"
	"github.com/ipmasq/ipmasq/readers/natview"
	agentshell "github.com/ipmasq/ipmasq/readers/shell"
	"github.com/ipmasq/ipmasq/reconcilers/nonmasqmaps"
	"github.com/ipmasq/ipmasq/settings"
)

func main() {
	root := newRootCommand()
	root.SetArgs(goStyleArgs(root.Flags(), os.Args[1:]))
	err := boolValueAsArgument(root.Flags(), os.Args[1:])
	if err == nil {
		err = root.Execute()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ipmasq-agent: %s\n", oneLine(err))
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	var pre preflight
	h := agent.New(pre.captureSettings())
	var upstream upstreamFlags
	var logLevel, logFormat string
	var showVersion bool
	root := &cobra.Command{
		Use:           "ipmasq-agent",
		Short:         "Masquerade agent for Linux and Kubernetes nodes, in eBPF",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if showVersion {
				_, err := fmt.Fprintln(cmd.OutOrStdout(), "ipmasq-agent", buildinfo.String())
				return err
			}
			log, err := newLogger(os.Stderr, logLevel, logFormat)
			if err != nil {
				return err
			}
			warnings, err := upstream.apply(cmd.Flags())
			if err != nil {
				return err
			}
			// Nothing is logged before the flags are known good.
			log = pre.holdLog(log)
			log.Info("Starting ipmasq-agent", "version", buildinfo.Version(), "revision", buildinfo.Revision(), "goversion", buildinfo.GoVersion())
			if err := rlimit.RemoveMemlock(); err != nil {
				return fmt.Errorf("remove memlock limit: %w", err)
			}
			setMemoryLimit(log)
			setGCPercent(log, os.LookupEnv)
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			go newMemoryReleaser(log).run(ctx, releaseCheckInterval)
			if err := pre.check(h, log); err != nil {
				return err
			}
			pre.release(warnings)
			return h.Run(log)
		},
	}
	root.Flags().BoolVar(&showVersion, "version", false, "Print the version (git describe of the build) and exit")
	root.Flags().StringVar(&logLevel, "log-level", envOr("IPMASQ_LOG_LEVEL", "info"), "Log level: debug, info, warn or error")
	root.Flags().StringVar(&logFormat, "log-format", envOr("IPMASQ_LOG_FORMAT", "text"), "Log format: text (key=value) or json (one object a line)")
	h.RegisterFlags(root.Flags())
	upstream.register(root.Flags())
	root.AddCommand(h.Command(), newMapsCommand(), newNATCommand(), newShellCommand(), newStatusCommand(), newUninstallCommand())
	return root
}

// newShellCommand is hive's shell client for an interactive session, and
// agentshell.Run for one command given as arguments, so that a failing
// command prints its one-line error once and exits 1.
func newShellCommand() *cobra.Command {
	cmd := hiveshell.ShellCmd(envOr("IPMASQ_SHELL_SOCK_PATH", agent.DefaultShellSock), "ipmasq> ", func(w io.Writer) {
		fmt.Fprintln(w, "ipmasq agent shell (read-only): db/show <table>, maps/dump, datapath/nat, datapath/counters, config/status, ipmasq/status; help lists all")
	})
	cmd.Short = "The agent's read-only shell: one command given as arguments, or an interactive session"
	interactive := cmd.Run
	cmd.Run = nil
	cmd.RunE = func(c *cobra.Command, args []string) error {
		if len(args) == 0 {
			interactive(c, args)
			return nil
		}
		sock, err := c.Flags().GetString(agentshell.SocketFlag)
		if err != nil {
			return err
		}
		return agentshell.Run(sock, c.OutOrStdout(), strings.Join(args, " "))
	}
	return cmd
}

// newStatusCommand prints a short summary of a running agent, asked over
// its shell socket.
func newStatusCommand() *cobra.Command {
	var sock string
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Summary of a running agent: config, prefixes, devices, endpoints, reconciliation, NAT occupancy",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return agentshell.Run(sock, cmd.OutOrStdout(), "ipmasq/status")
		},
	}
	cmd.Flags().StringVar(&sock, agentshell.SocketFlag, envOr("IPMASQ_SHELL_SOCK_PATH", agent.DefaultShellSock), "Path to the agent's shell socket")
	return cmd
}

// newMapsCommand prints the pinned maps without starting an agent, so an
// operator (or the demo) can see what the datapath consults.
func newMapsCommand() *cobra.Command {
	bpfRoot := settings.Default.BPFRoot
	cmd := &cobra.Command{
		Use:   "maps",
		Short: "Print the pinned non-masquerade maps as the kernel holds them",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := settings.Default
			cfg.BPFRoot = bpfRoot
			out, err := nonmasqmaps.Format(bpf.Pinned{Dir: cfg.PinDir()})
			if err != nil {
				return err
			}
			_, err = fmt.Fprint(cmd.OutOrStdout(), out)
			return err
		},
	}
	cmd.Flags().StringVar(&bpfRoot, "bpf-root", envOr("IPMASQ_BPF_ROOT", bpfRoot), "Mount point of the BPF filesystem the agent uses")
	return cmd
}

// newNATCommand lists the NAT pairs from the pinned maps, with or without
// a running agent, as conntrack -L lists connections.
func newNATCommand() *cobra.Command {
	bpfRoot := settings.Default.BPFRoot
	var o natview.Options
	cmd := &cobra.Command{
		Use:   "nat",
		Short: "List the NAT pairs like conntrack -L (filters, -o json, --summary like conntrack -S, --count like conntrack -C)",
		Long: "List the datapath's NAT pairs from the pinned maps: kind, family, protocol, state, age, time to expiry,\n" +
			"original tuple and the source it is translated to. The NAT entries hold no packet or byte counters.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg := settings.Default
			cfg.BPFRoot = bpfRoot
			return natview.Write(cmd.OutOrStdout(), bpf.Pinned{Dir: cfg.PinDir()}, o)
		},
	}
	cmd.Flags().StringVar(&bpfRoot, "bpf-root", envOr("IPMASQ_BPF_ROOT", bpfRoot), "Mount point of the BPF filesystem the agent uses")
	o.AddFlags(cmd.Flags())
	return cmd
}

// newLogger is the agent's logger on w: key=value text by default, or one
// JSON object a line for log collectors that parse fields.
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level=%q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format=%q: want text or json", format)
}

func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

// oneLine keeps the cause of a start failure and drops the hive's
// multi-line decoration so an operator sees one clear line.
func oneLine(err error) string {
	s := err.Error()
	var pe hive.ErrPopulate
	if errors.As(err, &pe) {
		// "failed to populate object graph: <root cause>"
		s = strings.TrimPrefix(pe.Error(), "failed to populate object graph: ")
	}
	return strings.ReplaceAll(s, "\n", "; ")
}
