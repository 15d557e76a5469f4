package shell

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// Run sends one command line to the shell at sock and copies its output to
// w. A command that fails returns its one-line error, which (unlike hive's
// shell.ShellExchange) is not also copied to w, so a caller that prints it
// prints it once.
func Run(sock string, w io.Writer, line string) error {
	if strings.ContainsAny(line, "\r\n") {
		return errors.New("one command line at a time")
	}
	conn, err := net.DialTimeout("unix", sock, 5*time.Second)
	if err != nil {
		return fmt.Errorf("no agent shell at %s (is the agent running, with the same --%s?): %w", sock, SocketFlag, err)
	}
	defer conn.Close()
	if _, err := fmt.Fprintf(conn, "%s\nexit\n", line); err != nil {
		return fmt.Errorf("send to %s: %w", sock, err)
	}
	r := bufio.NewReader(conn)
	for {
		text, err := r.ReadString('\n')
		if err != nil {
			if text == "" && errors.Is(err, io.EOF) {
				return fmt.Errorf("%s: the agent closed the shell before the command ended", sock)
			}
			if !errors.Is(err, io.EOF) {
				return fmt.Errorf("read from %s: %w", sock, err)
			}
		}
		text = strings.TrimSuffix(text, "\n")
		switch {
		case text == "[stdout]" || text == "[stderr]":
			// The engine's section markers: useful in tests, noise here.
		case strings.HasSuffix(text, errorMarker):
			return errors.New(strings.TrimSuffix(text, errorMarker))
		case strings.HasSuffix(text, endMarker):
			if rest := strings.TrimSuffix(text, endMarker); rest != "" {
				_, err := fmt.Fprintln(w, rest)
				return err
			}
			return nil
		default:
			if _, err := fmt.Fprintln(w, text); err != nil {
				return err
			}
		}
	}
}
