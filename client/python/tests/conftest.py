"""A kvdepotd of the test's own: KVDEPOTD names the server binary."""
import os
import subprocess
import tempfile
import time

import pytest


@pytest.fixture(scope="module")
def server():
    binary = os.environ.get("KVDEPOTD")
    if not binary:
        pytest.fail("KVDEPOTD must name the kvdepotd binary")
    with tempfile.TemporaryDirectory() as d:
        port_file = os.path.join(d, "port")
        log = open(os.path.join(d, "server.log"), "w")
        proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", "--data-dir", os.path.join(d, "data"),
             "--port-file", port_file, "--metrics-listen", "", "--threads", "2"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                if os.path.exists(port_file) and open(port_file).read().strip():
                    break
                if proc.poll() is not None:
                    pytest.fail("kvdepotd exited: " + open(log.name).read())
                time.sleep(0.05)
            else:
                pytest.fail("kvdepotd did not start")
            time.sleep(0.1)
            yield "127.0.0.1:" + open(port_file).read().strip()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
