import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `allowed_gids` against the groups the calling process has
/// (`SO_PEERGROUPS`), not the groups the user database lists for its uid:
/// a backend unit given `SupplementaryGroups=signerd-clients` could connect
/// to the socket file (the kernel checked that group) and was then refused
/// 403, since its user is not a member in /etc/group.
@Suite("Supplementary groups of the caller", .serialized)
struct PeerGroupsTests {
    @Test("SO_PEERGROUPS gives the connecting process's supplementary groups")
    func peerGroupsRead() throws {
        var pair: [Int32] = [0, 0]
        #expect(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &pair) == 0)
        defer { close(pair[0]); close(pair[1]) }
        let count = getgroups(0, nil)
        var own = [gid_t](repeating: 0, count: Int(max(count, 1)))
        let filled = getgroups(count, &own)
        let credentials = try #require(UnixListener.peerCredentials(pair[0]))
        let groups = try #require(credentials.groups, "the kernel gave no SO_PEERGROUPS (Linux 4.13 and later do)")
        #expect(Set(groups) == Set(own.prefix(Int(filled))))
        #expect(credentials.uid == getuid() && credentials.gid == getgid())
    }

    static let setprivAvailable = getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv")

    /// The status code of `GET /v1/keys` sent by python3 as uid/gid 65534
    /// with the supplementary groups `groups` (none when empty), followed
    /// by the error's `code` when it is not a 200 (`403 forbidden`).
    func statusAsNobody(socket: String, groups: [UInt32]) throws -> String {
        let script = "import socket,sys,json\ns=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            + "s.sendall(b'GET /v1/keys HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n')\nd=b''\nwhile True:\n    c=s.recv(65536)\n    if not c: break\n    d+=c\n"
            + "head,_,body=d.partition(b'\\r\\n\\r\\n'); status=head.split(b' ')[1].decode()\n"
            + "print(status if status=='200' else status+' '+json.loads(body)['error']['code'])"
        let groupOption = groups.isEmpty ? "--clear-groups" : "--groups=" + groups.map(String.init).joined(separator: ",")
        let result = try run(["setpriv", "--reuid=65534", "--regid=65534", groupOption, "--", "/usr/bin/python3", "-c", script, socket])
        return String(decoding: result, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
    }

    @Test("a caller whose process has a group in allowed_gids is served, the same uid without it gets 403",
          .enabled(if: setprivAvailable, "needs root and setpriv(1) to run a client as uid 65534 with chosen groups"))
    func supplementaryGroupAdmits() throws {
        let group: UInt32 = 4242  // in no user's group list in /etc/group
        let daemon = try InProcessDaemon(socketMode: 0o666) { $0.allowedGIDs = [group] }
        defer { daemon.stop() }
        #expect(try statusAsNobody(socket: daemon.socketPath, groups: [group]) == "200")
        #expect(try statusAsNobody(socket: daemon.socketPath, groups: [4243, group]) == "200")
        #expect(try statusAsNobody(socket: daemon.socketPath, groups: []) == "403 forbidden")
        #expect(try statusAsNobody(socket: daemon.socketPath, groups: [4243]) == "403 forbidden")
    }
}
