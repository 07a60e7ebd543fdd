"""Processes whose output the multi-process tests watch as it comes, to wait for an event (a line a
process prints) instead of sleeping for a guessed time."""
import subprocess, threading, time


class Watched:
    """subprocess.Popen with stdout and stderr read line by line by a thread each."""

    def __init__(self, argv, **popen):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
        self.lines = ([], [])  # stdout, stderr
        self.readers = [threading.Thread(target=lambda f=f, l=l: l.extend(iter(f.readline, "")), daemon=True)
                        for f, l in zip((self.p.stdout, self.p.stderr), self.lines)]
        for t in self.readers:
            t.start()

    def printed(self, text):
        return any(text in line for lines in self.lines for line in list(lines))

    def wait_for(self, text, timeout, what="the process"):
        """Returns once `text` appeared in its stdout or stderr. Raises AssertionError when the
        process exits without printing it, or when it does not within timeout s."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.printed(text):
                return
            if self.p.poll() is not None:
                for t in self.readers:
                    t.join(timeout=5)
                if self.printed(text):
                    return
                raise AssertionError(f"{what} exited ({self.p.returncode}) before printing {text!r}:\n"
                                     + "".join(self.lines[1])[-2000:])
            time.sleep(0.02)
        raise AssertionError(f"{what} did not print {text!r} within {timeout} s")

    def communicate(self, timeout):
        """(stdout, stderr) once it has exited; subprocess.TimeoutExpired if not within timeout s."""
        self.p.wait(timeout=timeout)
        for t in self.readers:  # they end at EOF, once the process has exited
            t.join(timeout=5)
        if not any(t.is_alive() for t in self.readers):
            self.p.stdout.close()
            self.p.stderr.close()
        return "".join(self.lines[0]), "".join(self.lines[1])

    def poll(self):
        return self.p.poll()

    def send_signal(self, sig):
        self.p.send_signal(sig)

    def kill(self):
        self.p.kill()

    @property
    def returncode(self):
        return self.p.returncode
