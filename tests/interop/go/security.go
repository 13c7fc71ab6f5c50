package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	pb "kvdinterop/kvdepot/v1"
)

// TLS, mTLS and bearer tokens against a server run with a certificate, a
// client CA and a tokens file, all made here with the openssl CLI; the client
// side is Go's crypto/tls.
func (s *suite) tSecurity() {
	pki := filepath.Join(s.workdir, "pki")
	if err := os.Mkdir(pki, 0o700); err != nil {
		fail("mkdir %s: %v", pki, err)
	}
	ssl := func(a ...string) {
		cmd := exec.Command("openssl", a...)
		cmd.Dir = pki
		if out, err := cmd.CombinedOutput(); err != nil {
			fatal("openssl %s failed (Debian package openssl): %v\n%s", a[0], err, out)
		}
	}
	ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
		"-days", "1", "-subj", "/CN=interop CA")
	for _, w := range []struct{ who, ext string }{{"server", "subjectAltName=DNS:kvdepot.test"}, {"client", ""}} {
		ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", w.who+".key", "-out", w.who+".csr",
			"-subj", "/CN="+w.who)
		extra := []string{}
		if w.ext != "" {
			if err := os.WriteFile(filepath.Join(pki, w.who+".ext"), []byte(w.ext+"\n"), 0o600); err != nil {
				fail("write %s.ext: %v", w.who, err)
			}
			extra = []string{"-extfile", w.who + ".ext"}
		}
		ssl(append([]string{"x509", "-req", "-in", w.who + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
			"-CAcreateserial", "-out", w.who + ".pem", "-days", "1"}, extra...)...)
	}
	tokens := filepath.Join(s.workdir, "tokens.yaml")
	if err := os.WriteFile(tokens, []byte(strings.Join([]string{
		"tokens:",
		`  - {token: go-rw-0123456789abc, tenant: go, namespaces: ["go-*"]}`,
		`  - {token: go-ro-0123456789abc, tenant: go, namespaces: ["go-*"], access: read-only}`,
		`  - {token: go-old-0123456789ab, tenant: go, namespaces: ["*"], expires: 2001-01-01T00:00:00Z}`,
		""}, "\n")), 0o600); err != nil {
		fail("write tokens: %v", err)
	}
	s.server.start(60*time.Second,
		"--tls-cert", filepath.Join(pki, "server.pem"), "--tls-key", filepath.Join(pki, "server.key"),
		"--tls-client-ca", filepath.Join(pki, "ca.pem"), "--tokens-file", tokens,
		"--metrics-listen", "")
	pool := x509.NewCertPool()
	caPem, err := os.ReadFile(filepath.Join(pki, "ca.pem"))
	if err != nil || !pool.AppendCertsFromPEM(caPem) {
		fail("load ca.pem: %v", err)
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "client.pem"), filepath.Join(pki, "client.key"))
	if err != nil {
		fail("load the client certificate: %v", err)
	}
	var opened []*api
	defer func() {
		for _, a := range opened {
			a.close()
		}
	}()
	connect := func(token string, clientCert bool, ready time.Duration) (*api, error) {
		conf := &tls.Config{RootCAs: pool, ServerName: "kvdepot.test"}
		if clientCert {
			conf.Certificates = []tls.Certificate{cert}
		}
		a, err := dial(s.server.addr, conf, token, ready)
		if err == nil {
			opened = append(opened, a)
		}
		return a, err
	}
	open := func(token string) *api { return must(connect(token, true, 30*time.Second)) }

	// Without a client certificate the server never completes the handshake:
	// the channel does not become ready, and no call gets through.
	if a, err := connect("", false, 1500*time.Millisecond); err == nil {
		_, herr := a.healthCheck("")
		check(herr != nil, "mTLS handshake succeeded without a client certificate")
	}
	anon := open("")
	eq(must(anon.healthCheck("")).Status, healthpb.HealthCheckResponse_SERVING,
		"health over mTLS without a token")
	expectCode(errOf(anon.listModels()), codes.Unauthenticated)
	for _, bad := range []string{"go-nope-0123456789a", "go-old-0123456789ab"} {
		expectCode(errOf(open(bad).listModels()), codes.Unauthenticated)
	}
	rw := open("go-rw-0123456789abc")
	must(rw.putModel(model("go-m", 2, 1, 0, 8, f16), false))
	expectCode(errOf(rw.putModel(model("other", 2, 1, 0, 8, f16), false)), codes.PermissionDenied)
	must(rw.create(&pb.CreateSequenceRequest{SequenceId: []byte("go-s"), Model: "go-m"}))
	data := randomBytes(2 * 2 * 3 * 8 * 2) // K+V, 2 layers, 3 tokens, 8 dims, f16
	must(rw.append("go-s", data, 0, 3, appendOpts{}))
	check(bytes.Equal(must(rw.read("go-s", readOpts{})).data, data), "bytes read back over mTLS differ")
	ro := open("go-ro-0123456789abc")
	expectCode(errOf(ro.append("go-s", data, 3, 3, appendOpts{})), codes.PermissionDenied)
	check(bytes.Equal(must(ro.read("go-s", readOpts{})).data, data), "read-only token read different bytes")
	eq(s.server.stop(30*time.Second), "0", "kvdepotd exit status on SIGTERM")
}
