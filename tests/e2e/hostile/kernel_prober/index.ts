import { spawnSync } from "node:child_process";

// Raw syscalls through ctypes: Python's fcntl.ioctl truncates the request to 32 bits, a raw
// syscall passes all 64 (the kernel reads the low 32; a filter comparing 64 must not be fooled).
const PROBE = String.raw`
import ctypes, errno, json, os, pty, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
HIGH = 0xFFFFFFFF00000000

def sysc(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[a if isinstance(a, ctypes.Array) else ctypes.c_ulong(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

def ioctl(fd, request, buf):
    return sysc(16, fd, request, buf)

out = {}
for where in ("/officer/user", "/tmp"):
    path = os.path.join(where, "probe-file")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
    for high in (0, HIGH):
        tag = " high" if high else ""
        out["FS_IOC_SETFLAGS " + where + tag] = ioctl(fd, high | 0x40086602, ctypes.create_string_buffer(8))
        out["FS_IOC_FSSETXATTR " + where + tag] = ioctl(fd, high | 0x401C5820, ctypes.create_string_buffer(28))
        args = ctypes.create_string_buffer(struct.pack("q", -1) + b"escape" + bytes(4088 - 6))
        out["BTRFS_IOC_SUBVOL_CREATE " + where + tag] = ioctl(dfd, high | 0x5000940E, args)
    os.close(fd); os.close(dfd); os.unlink(path)
params = ctypes.create_string_buffer(120)
out["io_uring_setup"] = sysc(425, 1, params)
out["userfaultfd"] = sysc(323, os.O_CLOEXEC | os.O_NONBLOCK)
out["keyctl"] = sysc(250, 0, ctypes.c_ulong(-4 & 0xFFFFFFFFFFFFFFFF).value, 0)  # KEYCTL_GET_KEYRING_ID of the session keyring
out["add_key"] = sysc(248, ctypes.create_string_buffer(b"user"), ctypes.create_string_buffer(b"k"), ctypes.create_string_buffer(b"v"), 1, 0xFFFFFFFFFFFFFFFD)
attr = ctypes.create_string_buffer(128)
struct.pack_into("IIQ", attr, 0, 1, 128, 0)  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK
struct.pack_into("Q", attr, 40, 1 << 5 | 1 << 6)  # exclude_kernel, exclude_hv
out["perf_event_open"] = sysc(298, attr, 0, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0)
bpf_attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1) + bytes(112))  # BPF_MAP_TYPE_ARRAY
out["bpf"] = sysc(321, 0, bpf_attr, 128)
out["file_setattr"] = sysc(469, 0xFFFFFF9C, ctypes.create_string_buffer(b"/tmp"), ctypes.create_string_buffer(32), 32, 0)

# What tools do need: terminal, pipe, socket and fd ioctls.
master, slave = pty.openpty()  # TIOCGPTN, TIOCSPTLCK
out["TCGETS"] = ioctl(slave, 0x5401, ctypes.create_string_buffer(60))
out["TIOCSWINSZ"] = ioctl(master, 0x5414, ctypes.create_string_buffer(struct.pack("HHHH", 24, 80, 0, 0)))
out["TIOCGWINSZ"] = ioctl(slave, 0x5413, ctypes.create_string_buffer(8))
out["TIOCGWINSZ high"] = ioctl(slave, HIGH | 0x5413, ctypes.create_string_buffer(8))
r, w = os.pipe()
os.write(w, b"abc")
n = ctypes.create_string_buffer(4)
out["FIONREAD"] = ioctl(r, 0x541B, n) + " " + str(struct.unpack("i", n.raw)[0])
out["FIONBIO"] = ioctl(r, 0x5421, ctypes.create_string_buffer(struct.pack("i", 1)))
out["FIOCLEX"] = ioctl(r, 0x5451, 0)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifc = ctypes.create_string_buffer(1024)
conf = ctypes.create_string_buffer(struct.pack("iQ", 1024, ctypes.addressof(ifc)))
out["SIOCGIFCONF"] = ioctl(s.fileno(), 0x8912, conf)
print(json.dumps(out))
`;

export async function execute() {
  const r = spawnSync("/usr/bin/python3", ["-c", PROBE], { encoding: "utf8", timeout: 10000, input: "" });
  if (r.status !== 0) throw new Error(`probe failed (${r.status}): ${(r.stderr || "").slice(-800)}`);
  const report = JSON.parse(r.stdout) as Record<string, string>;
  return { content: [{ type: "text", text: r.stdout.trim() }], details: report };
}
