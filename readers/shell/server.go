package shell

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/ipmasq/ipmasq/internal/unixsock"
)

// DefaultSocket is where the shell listens unless --shell-sock-path says
// otherwise.
const DefaultSocket = "/run/ipmasq/shell.sock"

// SocketFlag is the flag of the shell's socket path; "ipmasq-agent shell"
// and "ipmasq-agent status" take the same flag.
const SocketFlag = "shell-sock-path"

// The wire protocol of github.com/cilium/hive/shell, whose client
// ("ipmasq-agent shell", "ipmasq-agent status") talks to this server: the
// client sends one command per line; the server answers with the command's
// output and a line ending in endMarker, or the error on a line ending in
// errorMarker. "exit", "quit" or "stop" ends the session.
const (
	endMarker   = "<<end>>"
	errorMarker = "<<error>>"
)

// maxLine bounds a command line, so a client cannot make the agent buffer
// an endless one.
const maxLine = 64 << 10

// writeTimeout is how long a client may leave output unread before its
// session ends. A db/watch whose client stopped reading would otherwise
// block forever and keep the table's deleted rows in memory for it.
const writeTimeout = 30 * time.Second

// Config is the shell cell's command-line configuration.
type Config struct {
	// ShellSockPath is the unix socket of the shell; empty: no shell.
	ShellSockPath string `mapstructure:"shell-sock-path"`
}

// Flags implements cell.Flagger.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String(SocketFlag, def.ShellSockPath,
		"Unix socket of the agent's read-only shell, created with mode 0600 (ipmasq-agent shell, status); empty: no shell")
}

// Cell serves the read-only shell on --shell-sock-path.
var Cell = cell.Module(
	"shell",
	"Read-only operator shell on a unix socket",

	cell.Config(Config{ShellSockPath: DefaultSocket}),
	cell.Invoke(register),
)

func register(lc cell.Lifecycle, log *slog.Logger, cfg Config, in hive.ScriptCmds) {
	if cfg.ShellSockPath == "" {
		log.Info("No --shell-sock-path, not serving the shell")
		return
	}
	s := &server{
		log:    log,
		path:   cfg.ShellSockPath,
		engine: &script.Engine{Cmds: Commands(in.Map())},
		conns:  map[net.Conn]struct{}{},

		writeTimeout: writeTimeout,
	}
	lc.Append(cell.Hook{OnStart: s.start, OnStop: s.stop})
}

type server struct {
	log          *slog.Logger
	path         string
	engine       *script.Engine
	writeTimeout time.Duration

	ln     net.Listener
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

// start listens in the start hook, so that a socket another agent serves
// stops this one with a clear error instead of a silent takeover.
func (s *server) start(cell.HookContext) error {
	ln, err := unixsock.Listen("--"+SocketFlag, s.path, func(msg string, err error) {
		if err != nil {
			s.log.Error("Shell socket unusable", "error", err)
			return
		}
		s.log.Warn(msg)
	})
	if err != nil {
		return err
	}
	s.ln = ln
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.accept()
	s.log.Info("Shell listening (read-only)", "socket", s.path)
	return nil
}

func (s *server) stop(cell.HookContext) error {
	if s.ln == nil {
		return nil
	}
	s.cancel()
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

func (s *server) accept() {
	defer s.wg.Done()
	for {
		conn, err := s.ln.Accept()
		if err != nil {
			if s.ctx.Err() == nil {
				s.log.Error("Shell stopped accepting", "socket", s.path, "error", err)
			}
			return
		}
		s.mu.Lock()
		s.conns[conn] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serve(conn)
			s.mu.Lock()
			delete(s.conns, conn)
			s.mu.Unlock()
		}()
	}
}

// serve runs one client's commands until it says exit or goes away.
func (s *server) serve(conn net.Conn) {
	defer conn.Close()
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	// A failed write (client gone, or not reading for writeTimeout) cancels
	// the running command, e.g. an endless db/watch, and ends the session.
	w := &sessionWriter{conn: conn, timeout: s.writeTimeout, cancel: cancel}
	// No command of the read-only shell touches files, so the working
	// directory is never used.
	st, err := script.NewState(ctx, "/", nil)
	if err != nil {
		s.log.Error("Shell session", "error", err)
		return
	}
	defer st.CloseAndWait(io.Discard)

	sc := bufio.NewScanner(conn)
	sc.Buffer(make([]byte, 0, 4096), maxLine)
	for sc.Scan() {
		line := sc.Text()
		switch strings.TrimSpace(line) {
		case "exit", "quit", "stop":
			return
		}
		if err := s.execute(st, line, w); err != nil {
			fmt.Fprintf(w, "%s%s\n", describe(err), errorMarker)
		} else {
			fmt.Fprintln(w, endMarker)
		}
		if ctx.Err() != nil {
			return
		}
	}
	if errors.Is(sc.Err(), bufio.ErrTooLong) {
		fmt.Fprintf(w, "command line longer than %d bytes%s\n", maxLine, errorMarker)
	}
}

// execute runs one line; a panicking command ends as an error of that
// command, not of the agent or the session.
func (s *server) execute(st *script.State, line string, w io.Writer) (err error) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("Shell command panicked", "line", line, "panic", p)
			err = fmt.Errorf("%s: internal error: %v", strings.TrimSpace(line), p)
		}
	}()
	return s.engine.ExecuteLine(st, line, w)
}

// describe makes err one line without the script engine's "<stdin>:0:"
// position, which means nothing in a shell: "exec: not available ...".
func describe(err error) string {
	var r *refusal
	var ce *script.CommandError
	switch {
	case errors.As(err, &r):
		err = r
	case errors.As(err, &ce) && ce.Err != nil && ce.Err.Error() == "unknown command":
		err = fmt.Errorf("%s: unknown command; %s (help lists what the shell offers)", ce.Op, ErrNotAvailable)
	case errors.As(err, &ce):
		err = fmt.Errorf("%s: %w", strings.TrimSpace(ce.Op+" "+strings.Join(ce.Args, " ")), ce.Err)
	}
	return strings.ReplaceAll(strings.TrimRight(err.Error(), "\n"), "\n", "; ")
}

// sessionWriter writes a session's output with a deadline and cancels the
// session on the first failed write.
type sessionWriter struct {
	conn    net.Conn
	timeout time.Duration
	cancel  context.CancelFunc
}

func (w *sessionWriter) Write(p []byte) (int, error) {
	w.conn.SetWriteDeadline(time.Now().Add(w.timeout))
	n, err := w.conn.Write(p)
	if err != nil {
		w.cancel()
	}
	return n, err
}
