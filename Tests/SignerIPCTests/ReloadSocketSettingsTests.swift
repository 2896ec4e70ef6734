import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A reload compares the socket settings by what they do: an attack round
/// had a file refused for `socket_path` written with `//`, or for
/// `socket_group` naming the group the socket already had, and with it
/// every other edit in the file.
@Suite("Socket settings across a reload")
struct ReloadSocketSettingsTests {
    @Test("the same socket path written another way, and the socket's own group named, are no change; another path or group is refused, naming it")
    func comparedByValue() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        var info = stat()
        try #require(stat(daemon.socketPath, &info) == 0)
        var same = daemon.service.configuration
        same.socketPath = daemon.socketPath.replacingOccurrences(of: "/signerd.sock", with: "//./signerd.sock")
        same.socketGroup = String(info.st_gid)
        same.rateLimitPerSecond = 7  // applies at once, so it shows the reload was taken
        try daemon.service.reload(same)
        #expect(daemon.service.configuration.rateLimitPerSecond == 7)

        var moved = daemon.service.configuration
        moved.socketPath = daemon.directory + "/other.sock"
        let pathError = #expect(throws: ConfigurationError.self) { try daemon.service.reload(moved) }
        #expect(pathError?.message.hasPrefix("socket_path changed") == true, "\(String(describing: pathError))")

        var regrouped = daemon.service.configuration
        regrouped.socketGroup = String(info.st_gid == 65534 ? 0 : 65534)
        let groupError = #expect(throws: ConfigurationError.self) { try daemon.service.reload(regrouped) }
        #expect(groupError?.message.hasPrefix("socket_group changed") == true, "\(String(describing: groupError))")
        #expect(daemon.service.configuration.socketGroup == String(info.st_gid), "a refused reload changed the configuration")
        // Refused reloads leave the daemon serving on its socket.
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)))
    }

    @Test("samePath: repeated slashes and . components do not count; .. and other names do", arguments: [
        ("/run/signerd/signerd.sock", "/run//signerd/./signerd.sock", true),
        ("/run/signerd/signerd.sock", "/run/signerd/signerd.sock/", true),
        ("/run/signerd/signerd.sock", "/run/other/../signerd/signerd.sock", false),
        ("/run/signerd/signerd.sock", "/run/signerd/signerd2.sock", false),
        ("/run/signerd.sock", "run/signerd.sock", false),
    ])
    func samePath(a: String, b: String, expected: Bool) {
        #expect(UnixListener.samePath(a, b) == expected)
    }
}
