package shell

import (
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
)

// TestUnreadOutputEndsSession: a client that stops reading the output of an
// endless command (like db/watch) loses its session after writeTimeout, and
// the command stops, instead of blocking the agent forever.
func TestUnreadOutputEndsSession(t *testing.T) {
	stopped := make(chan struct{})
	flood := script.Command(script.CmdUsage{Summary: "write until the client goes away"},
		func(s *script.State, _ ...string) (script.WaitFunc, error) {
			defer close(stopped)
			line := make([]byte, 4096)
			for s.Context().Err() == nil {
				s.LogWriter().Write(line)
				if err := s.FlushLog(); err != nil {
					return nil, nil
				}
			}
			return nil, nil
		})
	srv := &server{
		log:          slog.New(slog.NewTextHandler(io.Discard, nil)),
		path:         filepath.Join(t.TempDir(), "shell.sock"),
		engine:       &script.Engine{Cmds: map[string]script.Cmd{"flood": flood}},
		conns:        map[net.Conn]struct{}{},
		writeTimeout: 200 * time.Millisecond,
	}
	if err := srv.start(cell.HookContext(t.Context())); err != nil {
		t.Fatal(err)
	}
	defer srv.stop(cell.HookContext(t.Context()))
	conn, err := net.Dial("unix", srv.path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("flood\n")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the command still runs 10s after its client stopped reading")
	}
}
