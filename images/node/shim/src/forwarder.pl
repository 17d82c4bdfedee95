# The loopback proxy's second acceptor (src/egress.js), for while the shim's event loop
# is blocked in a synchronous child process (execSync('curl ...')): the child's proxy
# connections would wait for the shim otherwise. fd 3 is the shim's listening socket;
# each connection is piped byte for byte to the egress socket at $ARGV[0]. Exits when
# fd 0, a pipe from the shim, ends. perl-base only (Debian's Essential perl, no modules):
# a few hundred kB.
use strict;
use warnings;

my $egress = shift @ARGV;
open(my $listen, '+<&=', 3) or die "sandboxd egress forwarder: fd 3: $!\n";
my (%handle, %peer); # fileno -> handle; fileno -> the other end's handle

sub close_pair {
    my ($fh) = @_;
    my $other = delete $peer{fileno $fh};
    for my $h ($fh, $other) {
        next unless defined $h;
        delete $peer{fileno $h};
        delete $handle{fileno $h};
        close $h;
    }
}

while (1) {
    my $rin = '';
    vec($rin, 0, 1) = 1;
    vec($rin, fileno $listen, 1) = 1;
    vec($rin, $_, 1) = 1 for keys %handle;
    my $n = select(my $rout = $rin, undef, undef, undef);
    next if $n < 0;
    if (vec($rout, 0, 1)) {
        my $got = sysread(STDIN, my $ignored, 512);
        exit 0 unless $got;
    }
    if (vec($rout, fileno $listen, 1)) {
        # The shim may have taken this one first: the socket is non-blocking.
        if (accept(my $client, $listen)) {
            # AF_UNIX = PF_UNIX = 1, SOCK_STREAM = 1 (Linux); struct sockaddr_un.
            my $up;
            if (socket($up, 1, 1, 0) and connect($up, pack('S Z108', 1, $egress))) {
                $handle{fileno $client} = $client;
                $handle{fileno $up} = $up;
                $peer{fileno $client} = $up;
                $peer{fileno $up} = $client;
            } else {
                close $client;
            }
        }
    }
    for my $fd (keys %handle) {
        next unless vec($rout, $fd, 1) and exists $handle{$fd};
        my $fh = $handle{$fd};
        my $got = sysread($fh, my $buf, 65536);
        if (!$got) {
            close_pair($fh);
            next;
        }
        my $to = $peer{$fd};
        my $off = 0;
        while ($off < $got) {
            my $w = syswrite($to, $buf, $got - $off, $off);
            if (!defined $w) {
                close_pair($fh);
                last;
            }
            $off += $w;
        }
    }
}
