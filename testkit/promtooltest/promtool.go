// Package promtooltest gives tests Prometheus' promtool, built from the
// tools/promtool module (a module of its own, so that the product's go.mod
// does not carry the Prometheus server) into the user's cache directory the
// first time, as testkit/kubetest builds kube-apiserver.
package promtooltest

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/ipmasq/ipmasq/testkit/toolbuild"
)

// Module is the Go module promtool is built from.
const Module = "github.com/prometheus/prometheus"

// Binary returns the path of promtool, building it from tools/promtool into
// <cache>/ipmasq/promtool-<version>/ the first time (several minutes on 2
// cores). The version is the one tools/promtool/go.mod requires.
func Binary() (string, error) {
	module, err := toolbuild.Module("promtool")
	if err != nil {
		return "", err
	}
	version, err := requiredVersion(filepath.Join(module, "go.mod"))
	if err != nil {
		return "", err
	}
	return toolbuild.Binary("promtool", "promtool", version, Module+"/cmd/promtool")
}

// requiredVersion is the version of Module that go.mod requires.
func requiredVersion(gomod string) (string, error) {
	f, err := os.Open(gomod)
	if err != nil {
		return "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) >= 2 && fields[0] == Module && strings.HasPrefix(fields[1], "v") {
			return fields[1], nil
		}
	}
	return "", fmt.Errorf("%s requires no %s", gomod, Module)
}
