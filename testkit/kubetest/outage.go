package kubetest

// KillWithEtcd stops the API server and etcd at once (SIGKILL), as a
// control plane outage does; RestartWithEtcd brings both back with
// etcd's data.
func (s *Server) KillWithEtcd() {
	s.Kill()
	if s.etcd != nil && s.etcd.Process != nil {
		s.etcd.Process.Kill()
		s.etcd.Wait()
		s.etcd = nil
	}
}

// RestartWithEtcd starts etcd (on its data directory) and the API server
// again after KillWithEtcd, and waits until the API server is ready.
func (s *Server) RestartWithEtcd() {
	s.t.Helper()
	s.startEtcd()
	s.Restart()
}
