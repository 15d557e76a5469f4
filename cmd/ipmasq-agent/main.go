// Command ipmasq-agent is the ipmasq node agent: it reads the ip-masq-agent
// config, keeps it in StateDB tables and writes the BPF maps the masquerade
// datapath consults.
//
//	ipmasq-agent --ip-masq-agent-config-path=/etc/config/ip-masq-agent
//	ipmasq-agent hive        # print the cell graph
//	ipmasq-agent --help      # every flag; each can also be set as IPMASQ_<FLAG>
package main

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/cilium/ebpf/rlimit"
	"github.com/cilium/hive"
	"github.com/spf13/cobra"

	"github.com/ipmasq/ipmasq/cells/agent"
)

func main() {
	if err := newRootCommand().Execute(); err != nil {
		fmt.Fprintf(os.Stderr, "ipmasq-agent: %s\n", oneLine(err))
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	h := agent.New()
	var logLevel string
	root := &cobra.Command{
		Use:           "ipmasq-agent",
		Short:         "Masquerade agent for Linux and Kubernetes nodes, in eBPF",
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := newLogger(logLevel)
			if err != nil {
				return err
			}
			if err := rlimit.RemoveMemlock(); err != nil {
				return fmt.Errorf("remove memlock limit: %w", err)
			}
			return h.Run(log)
		},
	}
	root.Flags().StringVar(&logLevel, "log-level", envOr("IPMASQ_LOG_LEVEL", "info"), "Log level: debug, info, warn or error")
	h.RegisterFlags(root.Flags())
	root.AddCommand(h.Command())
	return root
}

func newLogger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level=%q: want debug, info, warn or error", level)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l})), nil
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
	var pe hive.ErrPopulate
	if errors.As(err, &pe) {
		err = errors.Unwrap(err)
	}
	s := err.Error()
	s = strings.ReplaceAll(s, "\n", "; ")
	return s
}
