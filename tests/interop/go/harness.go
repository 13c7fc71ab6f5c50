// kvdepot interop test: gRPC-Go against a real kvdepotd.
//
// The client shares no code with kvdepot nor with gRPC's C core: the message
// types and stubs are generated at build time by protoc-gen-go from
// proto/kvdepot/v1/kvdepot.proto, the calls go through gRPC-Go (Debian's
// golang-google-grpc-dev), the health service through gRPC-Go's own
// grpc_health_v1 package. The prefix hash and the page checksum come from
// libxxhash (cgo), computed from their definitions in the .proto and
// docs/page-format.md.
//
// Usage:
//
//	kvd_interop_go --kvdepotd PATH [--large-mib N] [--large-only]
//	               [--security-only] [--keep]
//
// Each check prints "ok" or "FAIL" with the reason; the last line is
// "interop-go: N passed, N failed"; the exit status is non-zero when a check
// failed or a prerequisite is missing.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc/status"
)

const (
	prefix      = "interop-go"
	mib         = 1 << 20
	callTimeout = 60 * time.Second
)

// fatal reports a missing prerequisite: a failure, never a skip.
func fatal(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "%s: FATAL: %s\n", prefix, fmt.Sprintf(format, a...))
	fmt.Printf("%s: 0 passed, 1 failed\n", prefix)
	os.Exit(1)
}

// A failed check unwinds the check function with this value; run() recovers it.
type checkFailed struct{ msg string }

func fail(format string, a ...interface{}) {
	panic(checkFailed{fmt.Sprintf(format, a...)})
}

func check(cond bool, format string, a ...interface{}) {
	if !cond {
		fail(format, a...)
	}
}

func eq(got, want interface{}, what string) {
	if !reflect.DeepEqual(got, want) {
		fail("%s: got %v, want %v", what, got, want)
	}
}

// failErr turns an unexpected call error into a failed check.
func failErr(err error) {
	if st, ok := status.FromError(err); ok {
		fail("unexpected status %s: %s", st.Code(), st.Message())
	}
	fail("unexpected error: %v", err)
}

// must returns v, or fails the check when the call that made it failed.
func must[T any](v T, err error) T {
	if err != nil {
		failErr(err)
	}
	return v
}

// errOf keeps the error of a call, for expectCode.
func errOf[T any](_ T, err error) error { return err }

func errOf2[A, B any](_ A, _ B, err error) error { return err }

// try runs fn and returns the message of the check it failed (or of any
// other panic, with its stack), "" if none.
func try(fn func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			if cf, ok := r.(checkFailed); ok {
				msg = cf.msg
				return
			}
			msg = fmt.Sprintf("%v\n%s", r, debug.Stack())
		}
	}()
	fn()
	return ""
}

// ---------------------------------------------------------------------------
// The server under test

type server struct {
	exe, workdir, dataDir, logPath string
	cmd                            *exec.Cmd
	done                           chan struct{}
	exit                           string // "" while running
	addr                           string
}

func newServer(exe, workdir string) *server {
	return &server{exe: exe, workdir: workdir, dataDir: filepath.Join(workdir, "data"),
		logPath: filepath.Join(workdir, "kvdepotd.log")}
}

var portRe = regexp.MustCompile(`^\d+\n$`)

func (s *server) start(timeout time.Duration, extra ...string) {
	portFile := filepath.Join(s.workdir, "port")
	os.Remove(portFile)
	if err := os.MkdirAll(s.dataDir, 0o755); err != nil {
		fail("mkdir %s: %v", s.dataDir, err)
	}
	log, err := os.OpenFile(s.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fail("open %s: %v", s.logPath, err)
	}
	args := append([]string{"--listen", "127.0.0.1:0", "--data-dir", s.dataDir,
		"--port-file", portFile}, extra...)
	cmd := exec.Command(s.exe, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// The server dies with this process, so a test killed by its timeout
	// leaves no server behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Start()
	log.Close()
	if err != nil {
		fail("start kvdepotd: %v", err)
	}
	s.cmd, s.exit, s.done = cmd, "", make(chan struct{})
	go func(done chan struct{}) {
		err := cmd.Wait()
		ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
		switch {
		case ws.Signaled():
			s.exit = "signal " + ws.Signal().String()
		case err != nil && !ws.Exited():
			s.exit = "wait error " + err.Error()
		default:
			s.exit = strconv.Itoa(ws.ExitStatus())
		}
		close(done)
	}(s.done)
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-s.done:
			s.cmd = nil
			fail("kvdepotd exited (%s) before serving; log:\n%s", s.exit, s.logTail(40))
		default:
		}
		if b, err := os.ReadFile(portFile); err == nil && portRe.Match(b) {
			s.addr = "127.0.0.1:" + strings.TrimSpace(string(b))
			return
		}
		if time.Now().After(deadline) {
			s.kill()
			fail("kvdepotd wrote no port file in %v; log:\n%s", timeout, s.logTail(40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *server) alive() bool {
	if s.cmd == nil {
		return false
	}
	select {
	case <-s.done:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM and waits; it returns the exit status, or "" after a
// forced kill.
func (s *server) stop(timeout time.Duration) string {
	if s.cmd == nil {
		return ""
	}
	if s.alive() {
		s.cmd.Process.Signal(syscall.SIGTERM)
	}
	select {
	case <-s.done:
		s.cmd = nil
		return s.exit
	case <-time.After(timeout):
		s.kill()
		return ""
	}
}

func (s *server) kill() {
	if s.cmd == nil {
		return
	}
	if s.alive() {
		s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd = nil
}

// vmPeakKib is the server's peak virtual memory (VmPeak), in KiB.
func (s *server) vmPeakKib() int64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		fail("read the server's /proc status: %v", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) >= 2 && fs[0] == "VmPeak:" {
			n, err := strconv.ParseInt(fs[1], 10, 64)
			if err == nil {
				return n
			}
		}
	}
	fail("no VmPeak in /proc/%d/status", s.cmd.Process.Pid)
	return 0
}

func (s *server) logTail(lines int) string {
	b, err := os.ReadFile(s.logPath)
	if err != nil {
		return "(no log)"
	}
	all := strings.Split(string(bytes.TrimRight(b, "\n")), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// ---------------------------------------------------------------------------
// Arguments and the run

type args struct {
	kvdepotd     string
	largeMib     int
	largeOnly    bool
	securityOnly bool
	keep         bool
}

func parseArgs() args {
	var a args
	flag.StringVar(&a.kvdepotd, "kvdepotd", "", "path of the kvdepotd binary")
	flag.IntVar(&a.largeMib, "large-mib", 64, "size of the large sequence, MiB")
	flag.BoolVar(&a.largeOnly, "large-only", false, "only the large sequence and restart")
	flag.BoolVar(&a.securityOnly, "security-only", false, "only the TLS, mTLS and token checks")
	flag.BoolVar(&a.keep, "keep", false, "keep the working directory")
	flag.Parse()
	if a.kvdepotd == "" || flag.NArg() != 0 {
		fatal("usage: kvd_interop_go --kvdepotd PATH [--large-mib N] [--large-only] " +
			"[--security-only] [--keep]")
	}
	if a.largeMib < 1 {
		fatal("--large-mib must be >= 1")
	}
	if st, err := os.Stat(a.kvdepotd); err != nil || st.Mode()&0o111 == 0 {
		fatal("kvdepotd not found or not executable: %s", a.kvdepotd)
	}
	return a
}

func main() {
	a := parseArgs()
	workdir, err := os.MkdirTemp("", "kvd-interop-go-")
	if err != nil {
		fatal("temporary directory: %v", err)
	}
	s := newSuite(a, workdir)
	// A hung call must not hang ctest forever: the whole run has a ceiling.
	guard := time.AfterFunc(1800*time.Second, func() {
		fmt.Printf("%s: FATAL: overall time limit reached\n", prefix)
		s.server.kill()
		os.Exit(1)
	})
	s.main()
	guard.Stop()
	s.cleanup()
	fmt.Printf("%s: %d passed, %d failed\n", prefix, s.passed, s.failed)
	if s.failed > 0 || s.passed == 0 {
		os.Exit(1)
	}
}
