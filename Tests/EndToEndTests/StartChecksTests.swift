import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Synchronization
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `signerd --check-config` (the unit's `ExecStartPre=`) passed files that
/// then stopped the start with 78: a PIN file others could read, a missing
/// PIN file, a missing module. It now checks them without touching the token.
@Suite("signerd --check-config: the files the start needs")
struct CheckConfigTests {
    /// Writes `daemon`'s configuration with `token_uri` changed by `edit`, then runs `--check-config` on it.
    func checkConfig(_ daemon: DaemonHarness, environment: [String: String] = [:], _ edit: (String) -> String) throws -> (status: Int32, stdout: String, stderr: String) {
        try daemon.writeConfig(["token_uri": edit(daemon.tokenURI)])
        return runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: environment)
    }

    /// The PIN file `daemon`'s token URI names.
    func pinPath(_ daemon: DaemonHarness) throws -> String {
        let source = try #require(daemon.tokenURI.split(separator: "&").first { $0.hasPrefix("pin-source=") }).dropFirst("pin-source=".count)
        return String(source).removingPercentEncoding.map { $0.hasPrefix("file:") ? String($0.dropFirst(5)) : $0 } ?? ""
    }

    /// `uri` with its `module-path` set to `path`.
    func replacingModulePath(_ uri: String, with path: String) -> String {
        let current = uri.split(separator: "&").flatMap { $0.split(separator: "?") }.first { $0.hasPrefix("module-path=") } ?? ""
        return uri.replacingOccurrences(of: String(current), with: "module-path=\(path)")
    }

    @Test("a PIN file others may read, a missing PIN file and a missing module are 78 with the reason; a good file is 0")
    func filesChecked() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let pin = try pinPath(daemon)
        #expect(FileManager.default.fileExists(atPath: pin), "\(pin)")

        let good = try checkConfig(daemon) { $0 }
        #expect(good.status == 0, "\(good.stderr)")
        #expect(good.stdout.contains("is valid") && !good.stdout.contains("note:"), "\(good.stdout)")
        #expect(good.stdout.contains("warning: socket_open_to_all_users: "), "advisories are shown too: \(good.stdout)")

        chmod(pin, 0o644)
        let readable = try checkConfig(daemon) { $0 }
        #expect(readable.status == 78, "\(readable.stdout)")
        #expect(readable.stderr.contains("pin_source_insecure") || readable.stderr.contains("readable or writable by other users"), "\(readable.stderr)")
        #expect(readable.stderr.hasPrefix("error: config_invalid: "), "plain text for a person, not a JSON log line: \(readable.stderr)")
        chmod(pin, 0o600)

        let noFile = runProgram(Binaries.signerd, ["--config", daemon.directory + "/absent.json", "--check-config"])
        #expect(noFile.status == 78)
        #expect(noFile.stderr.hasPrefix("error: config_invalid: cannot read the configuration file") && noFile.stderr.contains("No such file or directory"), "\(noFile.stderr)")

        let missingPIN = try checkConfig(daemon) { $0.replacingOccurrences(of: pin, with: daemon.directory + "/no-such-pin") }
        #expect(missingPIN.status == 78)
        #expect(missingPIN.stderr.contains("no-such-pin") && missingPIN.stderr.contains("No such file"), "\(missingPIN.stderr)")

        let missingModule = try checkConfig(daemon) { replacingModulePath($0, with: "/usr/lib/libnothere-pkcs11.so") }
        #expect(missingModule.status == 78)
        #expect(missingModule.stderr.contains("libnothere-pkcs11.so"), "\(missingModule.stderr)")
        let notALibrary = try checkConfig(daemon) { replacingModulePath($0, with: daemon.configPath) }
        #expect(notALibrary.status == 78)
        #expect(notALibrary.stderr.contains("is not a shared library"), "\(notALibrary.stderr)")
        #expect(!missingModule.stderr.contains(try String(contentsOfFile: pin, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)), "no PIN in the output")
    }

    /// open(2) on a FIFO waits for a writer, and signerd blocks SIGTERM
    /// from its first line: `--check-config` (and the start) hung for good,
    /// deaf to `timeout` and to systemd's stop.
    @Test("a PIN file that is a FIFO is 78 at once, without waiting for a writer")
    func fifoPINFile() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let pin = try pinPath(daemon)
        let fifo = daemon.directory + "/pin-fifo"
        #expect(makeFIFO(fifo))
        let started = Date()
        let checked = try checkConfig(daemon) { $0.replacingOccurrences(of: pin, with: fifo) }
        #expect(Date().timeIntervalSince(started) < 5, "waited for a writer")
        #expect(checked.status == 78)
        #expect(checked.stderr.contains("pin-fifo") && checked.stderr.contains("not a regular file"), "\(checked.stderr)")
    }

    /// p11-kit loads a relative `module-path` from its own module directory
    /// (`p11-kit-trust.so` is /usr/lib/<arch>/pkcs11/p11-kit-trust.so), so
    /// the start opens it; `--check-config` looked for it in the current
    /// directory and said 78 "cannot be found", so `ExecStartPre=` stopped a
    /// service that would have started.
    @Test("a relative module-path is left to p11-kit, with a note, not refused as missing")
    func relativeModulePath() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let checked = try checkConfig(daemon) { uri in
            let path = uri.split(separator: "&").flatMap { $0.split(separator: "?") }.first { $0.hasPrefix("module-path=") } ?? ""
            return uri.replacingOccurrences(of: String(path), with: "module-path=p11-kit-trust.so")
        }
        #expect(checked.status == 0, "\(checked.stderr)")
        #expect(checked.stdout.contains("note: module-path=p11-kit-trust.so is relative"), "\(checked.stdout)")
    }

    /// `--check-config` passed files the start then failed on (a socket
    /// mode that shuts out signerd's own user), and said nothing of a
    /// missing socket directory or a PIN in the URI, which the start logs.
    @Test("a socket_mode without owner read and write is 78; a pin-value and a missing socket directory are warnings, exit 0")
    func socketAndPINValue() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        try daemon.writeConfig(["socket_mode": "0000"])
        let closed = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"])
        #expect(closed.status == 78, "\(closed.stdout)")
        #expect(closed.stderr.hasPrefix("error: config_invalid: ") && closed.stderr.contains("socket_mode must let the socket's owner"), "\(closed.stderr)")

        let absent = daemon.directory + "/no-such-dir"
        try daemon.writeConfig(["socket_path": absent + "/signerd.sock"])
        let noDirectory = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"])
        #expect(noDirectory.status == 0, "\(noDirectory.stderr)")
        #expect(noDirectory.stdout.contains("warning: socket_directory_missing: the directory \(absent) of socket_path"), "\(noDirectory.stdout)")
        #expect(noDirectory.stdout.contains("No such file or directory") && noDirectory.stdout.contains("RuntimeDirectory="), "\(noDirectory.stdout)")
        // The start itself says how to give the socket its directory, as --check-config does.
        let started = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(started.status == 69, "\(started.stderr)")
        let bindFailed = started.stderr.split(separator: "\n").first { $0.contains("\"socket_bind_failed\"") }
        #expect(bindFailed?.contains("install -d -o $(id -un) \(absent)") == true && bindFailed?.contains("RuntimeDirectory=signerd") == true, "\(started.stderr)")
        #expect(!started.stderr.contains("\"token_opened\""), "it logged in to the token before finding the socket unbindable: \(started.stderr)")

        let pin = try String(contentsOfFile: pinPath(daemon), encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
        let inURI = try checkConfig(daemon) { uri in
            uri.split(separator: "&", omittingEmptySubsequences: false).map { $0.hasPrefix("pin-source=") ? "pin-value=\(pin)" : String($0) }.joined(separator: "&")
        }
        #expect(inURI.status == 0, "\(inURI.stderr)")
        #expect(inURI.stdout.contains("warning: pin_value_in_uri: use pin-source=file:/path with mode 0600 instead of pin-value"), "\(inURI.stdout)")
        #expect(!inURI.stdout.contains("socket_directory_missing"), "the harness's socket directory exists: \(inURI.stdout)")
        #expect(!inURI.stdout.contains(pin) && !inURI.stderr.contains(pin), "no PIN in the output")
    }

    /// A second signerd on the same configuration logged in to the token
    /// (SoftHSM rewrites its token file at C_Login) before it found the
    /// socket taken (an operator runbook audit).
    @Test("a second signerd on the same socket is refused (69) before it opens the token; the first keeps serving")
    func secondInstance() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { _ = daemon.stop() }
        let second = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(second.status == 69, "\(second.stderr)")
        #expect(second.stderr.contains("\"socket_bind_failed\"") && second.stderr.contains("another process is listening on \(daemon.socketPath)"), "\(second.stderr)")
        #expect(!second.stderr.contains("\"token_opened\""), "it logged in to the token first: \(second.stderr)")
        let request = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        #expect(daemon.verifies(try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(request.utf8))))
    }

    /// A socket path the bind would fail on was found only at the bind,
    /// after `C_Login` (which SoftHSM records by rewriting its token file):
    /// a service restarting on such a fault logged in on every start.
    @Test("a socket path the bind would fail on (a file there, a file for its directory) is refused (69) before the token is opened; the file is left alone",
          arguments: ["not_a_socket", "parent_not_directory"])
    func unbindableBeforeLogin(_ fault: String) throws {
        let daemon = try DaemonHarness()
        let says: String
        let file: String
        if fault == "not_a_socket" {
            file = daemon.socketPath
            says = "\(daemon.socketPath) exists and is not a socket; refusing to replace it"
        } else {
            file = daemon.directory + "/plain"
            try daemon.writeConfig(["socket_path": file + "/signerd.sock"])
            says = "cannot bind \(file)/signerd.sock: \(file) is not a directory"
        }
        try Data("keep me".utf8).write(to: URL(fileURLWithPath: file))
        let tokenFile = try tokenObjectFiles(daemon)
        let started = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(started.status == 69, "\(started.stderr)")
        #expect(started.stderr.contains("\"socket_bind_failed\"") && started.stderr.contains(says), "\(started.stderr)")
        #expect(!started.stderr.contains("\"token_opened\""), "it logged in to the token first: \(started.stderr)")
        #expect(try tokenObjectFiles(daemon) == tokenFile, "SoftHSM's token files were not rewritten")
        #expect(try String(contentsOfFile: file, encoding: .utf8) == "keep me")
    }

    /// Each file in the harness's SoftHSM token directory with its size and
    /// modification time in nanoseconds: what a `C_Login` rewrites.
    private func tokenObjectFiles(_ daemon: DaemonHarness) throws -> [String: [Int]] {
        var files: [String: [Int]] = [:]
        let root = daemon.directory + "/hsm/tokens"
        let enumerator = FileManager.default.enumerator(atPath: root)
        while let name = enumerator?.nextObject() as? String {
            var info = stat()
            guard lstat(root + "/" + name, &info) == 0, info.st_mode & S_IFMT == S_IFREG else { continue }
            files[name] = [Int(info.st_size), Int(info.st_mtim.tv_sec), Int(info.st_mtim.tv_nsec)]
        }
        #expect(!files.isEmpty, "found the token files under \(root)")
        return files
    }

    /// A root signerd bound its socket, then chown/chmod by path: in a
    /// directory another user could write, that user swapped the socket for
    /// a link to /etc/shadow in between (an attack round won it on the
    /// first or second start).
    @Test("a socket directory others may write without the sticky bit, or another user's, is refused at start (69) and warned of by --check-config; a sticky one is not",
          .enabled(if: geteuid() == 0, "giving the directory to another uid needs root"))
    func unsafeSocketDirectory() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let directory = daemon.directory + "/sockets"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: false)
        try daemon.writeConfig(["socket_path": directory + "/signerd.sock"])
        for (mode, owner, says) in [(0o777, uid_t(0), "may be written by other users without the sticky bit"), (0o755, uid_t(65534), "belongs to another user")] {
            #expect(chmod(directory, mode_t(mode)) == 0 && chown(directory, owner, 0) == 0)
            let checked = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
            #expect(checked.status == 0 && checked.stdout.contains("warning: socket_directory_unsafe: socket_path \(directory)/signerd.sock lies below the directory \(directory) (") && checked.stdout.contains(says), "\(checked.stdout)")
            // Bounded: a signerd that binds there anyway would serve until stopped.
            let started = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
            #expect(started.status == 69, "\(started.stderr)")
            #expect(started.stderr.contains("\"socket_bind_failed\"") && started.stderr.contains(says), "\(started.stderr)")
            #expect(!FileManager.default.fileExists(atPath: directory + "/signerd.sock"), "nothing was bound")
        }
        #expect(chown(directory, 0, 0) == 0 && chmod(directory, 0o1777) == 0)
        let sticky = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(sticky.status == 0 && !sticky.stdout.contains("socket_directory_unsafe"), "like /tmp: \(sticky.stdout)")
        // A safe directory below one another user owns: that user could swap
        // the whole directory between bind and chmod (renameat2 RENAME_EXCHANGE),
        // which a second attack round did. Every directory up to / is checked.
        let parent = daemon.directory + "/theirs"
        try FileManager.default.createDirectory(atPath: parent + "/sockets", withIntermediateDirectories: true)
        #expect(chown(parent, 65534, 65534) == 0 && chmod(parent, 0o755) == 0 && chmod(parent + "/sockets", 0o755) == 0)
        try daemon.writeConfig(["socket_path": parent + "/sockets/signerd.sock"])
        let below = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(below.status == 69 && below.stderr.contains("lies below the directory \(parent) (owner uid 65534") && below.stderr.contains("belongs to another user"), "\(below.stderr)")
        // Group write: refused for a group with other members than this user
        // (nogroup here) or through an ACL; allowed for root's own group.
        let grouped = daemon.directory + "/grouped"
        try FileManager.default.createDirectory(atPath: grouped, withIntermediateDirectories: false)
        try daemon.writeConfig(["socket_path": grouped + "/signerd.sock"])
        func check() -> String { runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf]).stdout }
        #expect(chown(grouped, 0, 65534) == 0 && chmod(grouped, 0o775) == 0)
        #expect(check().contains("may be written by its group, which is not this process's group (gid 0)"), "\(check())")
        #expect(chown(grouped, 0, 0) == 0 && chmod(grouped, 0o775) == 0)
        #expect(!check().contains("socket_directory_unsafe"), "root's own group, with no other member: \(check())")
        try grantWriteByACL(grouped, uid: 65534)
        #expect(check().contains("has an access control list that lets users or groups besides its owner write it"), "\(check())")
    }

    /// Gives `uid` write access to `directory` with a POSIX ACL
    /// (`setfacl -m u:UID:rwx`, written as the `system.posix_acl_access`
    /// attribute by python3, since the acl package is not a dependency).
    func grantWriteByACL(_ directory: String, uid: UInt32) throws {
        let script = """
        import os, struct, sys
        undefined = 0xFFFFFFFF
        entries = [(0x01, 7, undefined), (0x02, 7, int(sys.argv[2])), (0x04, 5, undefined), (0x10, 7, undefined), (0x20, 5, undefined)]
        os.setxattr(sys.argv[1], "system.posix_acl_access", struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))
        """
        let set = runProgram("/usr/bin/env", ["python3", "-c", script, directory, String(uid)])
        try #require(set.status == 0, "setting a POSIX ACL: \(set.stderr)")
    }

    /// The module check resolved the path with realpath(3) and passed it
    /// when that failed; a second attack round made the resolved path longer
    /// than PATH_MAX through two symbolic links, and its library ran as root.
    @Test("a module path that cannot be resolved (longer than PATH_MAX), one that climbs out of p11-kit's directory, or one below another user's directory is refused (78)",
          .enabled(if: geteuid() == 0, "giving a directory to another uid needs root"))
    func moduleCheckCannotBeBypassed() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let environment = ["SOFTHSM2_CONF": daemon.softHSMConf]
        let module = FileManager.default.contents(atPath: try #require(realpath(SoftHSMFixture.shared.modulePath, nil).map { String(cString: $0) })) ?? Data()
        // Two chains of 14 directories with 200-character names, joined by links: each
        // link and each path given is short, the resolved path about 5,600 bytes.
        let base = daemon.directory + "/long"
        try FileManager.default.createDirectory(atPath: base, withIntermediateDirectories: false)
        let name = String(repeating: "d", count: 200)
        let chain = Array(repeating: name, count: 14).joined(separator: "/")
        var fd = open(base, O_RDONLY | O_DIRECTORY)
        for level in 0..<28 {
            if level == 14 { #expect(symlinkat(chain, fd, "L2") == 0) }  // inside the first chain, pointing down the second
            #expect(mkdirat(fd, name, 0o755) == 0)
            let next = openat(fd, name, O_RDONLY | O_DIRECTORY)
            close(fd)
            fd = next
        }
        let file = openat(fd, "libsofthsm2.so", O_WRONLY | O_CREAT | O_EXCL, 0o755)
        _ = module.withUnsafeBytes { write(file, $0.baseAddress, $0.count) }
        close(file)
        close(fd)
        #expect(symlink(chain, base + "/L1") == 0)
        let long = base + "/L1/L2/libsofthsm2.so"
        #expect(realpath(long, nil) == nil && errno == ENAMETOOLONG, "the kernel resolves it, realpath(3) cannot")
        defer {
            // FileManager gave up on this tree without a word, leaving a token and its PIN in /tmp.
            #expect(TemporaryDirectory.removeTree(base) && access(base, F_OK) != 0, "the tree deeper than PATH_MAX is removed")
        }
        // Walked link by link, the directories past PATH_MAX cannot be checked at all.
        for (modulePath, says) in [(long, "cannot be checked (File name too long)"),
                                   ("../../../../../../../.." + base + "/L1/L2/libsofthsm2.so", "climbs out of p11-kit's module directory")] {
            try daemon.writeConfig(["token_uri": replacingModulePath(daemon.tokenURI, with: modulePath)])
            for arguments in [[Binaries.signerd, "--config", daemon.configPath, "--check-config"], [Binaries.signctl, "--config", daemon.configPath, "keys", "list"]] {
                let refused = runProgram(arguments[0], Array(arguments.dropFirst()), environment: environment)
                #expect(refused.status == 78 && refused.stderr.contains("module_insecure") && refused.stderr.contains(says), "\(arguments): \(refused.stderr)")
            }
        }
        // A module missing below another user's directory: refused, not left
        // to the load (which another round won by swapping the directory in).
        let missing = daemon.directory + "/theirs-missing"
        try FileManager.default.createDirectory(atPath: missing, withIntermediateDirectories: false)
        #expect(chown(missing, 65534, 65534) == 0)
        try daemon.writeConfig(["token_uri": replacingModulePath(daemon.tokenURI, with: missing + "/libsofthsm2.so")])
        let absent = runProgram(Binaries.signctl, ["--config", daemon.configPath, "keys", "list"], environment: environment)
        #expect(absent.status == 78 && absent.stderr.contains("module_not_found: the PKCS#11 module \(missing)/libsofthsm2.so cannot be found"), "\(absent.stderr)")
        // A root:root directory that a POSIX ACL lets another user write (the
        // group bits are then the ACL's mask): a third round ran its library as root.
        let acl = daemon.directory + "/acl-module"
        try FileManager.default.createDirectory(atPath: acl, withIntermediateDirectories: false)
        try module.write(to: URL(fileURLWithPath: acl + "/libsofthsm2.so"))
        try grantWriteByACL(acl, uid: 65534)
        try daemon.writeConfig(["token_uri": replacingModulePath(daemon.tokenURI, with: acl + "/libsofthsm2.so")])
        let aclRefused = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: environment)
        #expect(aclRefused.status == 78 && aclRefused.stderr.contains("the directory \(acl) (") && aclRefused.stderr.contains("has an access control list"), "\(aclRefused.stderr)")
        // A root-owned directory and module below a directory another user owns.
        let theirs = daemon.directory + "/theirs-module"
        try FileManager.default.createDirectory(atPath: theirs + "/lib", withIntermediateDirectories: true)
        try module.write(to: URL(fileURLWithPath: theirs + "/lib/libsofthsm2.so"))
        #expect(chown(theirs, 65534, 65534) == 0 && chmod(theirs, 0o755) == 0)
        try daemon.writeConfig(["token_uri": replacingModulePath(daemon.tokenURI, with: theirs + "/lib/libsofthsm2.so")])
        let below = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: environment)
        #expect(below.status == 78 && below.stderr.contains("the directory \(theirs) (owner uid 65534") && below.stderr.contains("belongs to another user"), "\(below.stderr)")
    }

    /// The configuration file chooses the module loaded into a root process;
    /// one another user could write ran that user's code as root.
    @Test("a configuration file others may write or another user owns, and a PKCS#11 module others may change, are refused (78) by signerd and signctl",
          .enabled(if: geteuid() == 0, "giving files to another uid needs root"))
    func insecureConfigurationAndModule() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let environment = ["SOFTHSM2_CONF": daemon.softHSMConf]
        #expect(chmod(daemon.configPath, 0o666) == 0)
        for arguments in [[Binaries.signerd, "--config", daemon.configPath, "--check-config"], [Binaries.signctl, "--config", daemon.configPath, "keys", "list"]] {
            let refused = runProgram(arguments[0], Array(arguments.dropFirst()), environment: environment)
            #expect(refused.status == 78 && refused.stderr.contains("may be written by other users (mode 666)"), "\(arguments): \(refused.stderr)")
        }
        #expect(chmod(daemon.configPath, 0o644) == 0 && chown(daemon.configPath, 65534, 65534) == 0)
        let owned = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: environment)
        #expect(owned.status == 78 && owned.stderr.contains("belongs to uid 65534, neither root nor this process's uid 0"), "\(owned.stderr)")
        #expect(chown(daemon.configPath, 0, 0) == 0)

        // The module, copied to a directory others may write.
        let modules = daemon.directory + "/modules"
        try FileManager.default.createDirectory(atPath: modules, withIntermediateDirectories: false)
        let realModule = try #require(realpath(SoftHSMFixture.shared.modulePath, nil).map { String(cString: $0) })
        try FileManager.default.copyItem(atPath: realModule, toPath: modules + "/libsofthsm2.so")
        try daemon.writeConfig(["token_uri": replacingModulePath(daemon.tokenURI, with: modules + "/libsofthsm2.so")])
        let safe = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: environment)
        #expect(safe.status == 0, "a root-owned copy in a root-owned directory loads: \(safe.stderr)")
        #expect(chmod(modules, 0o777) == 0)
        for arguments in [[Binaries.signerd, "--config", daemon.configPath, "--check-config"], ["/usr/bin/timeout", "10", Binaries.signerd, "--config", daemon.configPath], [Binaries.signctl, "--config", daemon.configPath, "keys", "list"]] {
            let refused = runProgram(arguments[0], Array(arguments.dropFirst()), environment: environment)
            #expect(refused.status == 78 && refused.stderr.contains("module_insecure") && refused.stderr.contains("the directory \(modules) (owner uid 0, group gid 0, mode 777) may be written by other users"), "\(arguments): \(refused.stderr)")
        }
    }

    @Test("a PIN file from LoadCredential= is left to the service's start, with a note, outside the service")
    func credentialsOutsideTheService() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let pin = try pinPath(daemon)
        let outside = runProgram("/usr/bin/env", ["-u", "CREDENTIALS_DIRECTORY", Binaries.signerd, "--config", daemon.configPath, "--check-config"])
        #expect(outside.status == 0, "\(outside.stderr)")
        // A service name of its own: this host may run a real signerd.service.
        let credential = "/run/credentials/signerd-test-\(UUID().uuidString).service/pin"
        try daemon.writeConfig(["token_uri": daemon.tokenURI.replacingOccurrences(of: pin, with: credential)])
        let noted = runProgram("/usr/bin/env", ["-u", "CREDENTIALS_DIRECTORY", Binaries.signerd, "--config", daemon.configPath, "--check-config"])
        #expect(noted.status == 0, "\(noted.stderr)")
        #expect(noted.stdout.contains("note: the PIN file \(credential) exists only inside the service"), "\(noted.stdout)")
        // Started by hand with the service's configuration: 78, and how to start it instead.
        let byHand = runProgram("/usr/bin/env", ["-u", "CREDENTIALS_DIRECTORY", "SOFTHSM2_CONF=\(daemon.softHSMConf)", "/usr/bin/timeout", "10", Binaries.signerd, "--config", daemon.configPath])
        #expect(byHand.status == 78, "\(byHand.stderr)")
        let openFailed = byHand.stderr.split(separator: "\n").first { $0.contains("\"token_open_failed\"") }
        #expect(openFailed?.contains("is systemd's copy of the PIN (LoadCredential=), which exists only inside the running service: start signerd with systemctl start signerd") == true, "\(byHand.stderr)")
        // A path that only starts like a credential is checked like any other.
        try daemon.writeConfig(["token_uri": daemon.tokenURI.replacingOccurrences(of: pin, with: "/run/credentials/../..\(daemon.directory)/absent.pin")])
        let dotted = runProgram("/usr/bin/env", ["-u", "CREDENTIALS_DIRECTORY", Binaries.signerd, "--config", daemon.configPath, "--check-config"])
        #expect(dotted.status == 78, "\(dotted.stdout)")
        try daemon.writeConfig(["token_uri": daemon.tokenURI.replacingOccurrences(of: pin, with: credential)])
        // Inside the service ($CREDENTIALS_DIRECTORY set) the file is checked.
        let inside = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"], environment: ["CREDENTIALS_DIRECTORY": (credential as NSString).deletingLastPathComponent])
        #expect(inside.status == 78, "\(inside.stdout)")
        #expect(inside.stderr.contains(credential), "\(inside.stderr)")
    }
}

/// A PIN the token refuses when signerd or signctl opens it: the only report
/// is the caller's, with advice that fits a process that is not running.
@Suite("a PIN refused when the token is opened")
struct PINRefusedAtOpenTests {
    @Test("signerd exits 77 with token_open_failed telling to start again, not to reload; signctl prints only its own error")
    func refusedAtStart() throws {
        let daemon = try DaemonHarness()
        let pin = try CheckConfigTests().pinPath(daemon)
        let right = try String(contentsOfFile: pin, encoding: .utf8)
        try writeSecretFile(pin, String(repeating: "9", count: right.trimmingCharacters(in: .whitespacesAndNewlines).count) + "\n")
        defer { try? writeSecretFile(pin, right) }

        let start = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", daemon.configPath], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(start.status == 77, "\(start.stderr)")
        let failed = start.stderr.split(separator: "\n").filter { $0.contains("\"token_open_failed\"") }
        #expect(failed.count == 1 && failed[0].contains("CKR_PIN_INCORRECT") && failed[0].contains("start signerd again"), "\(start.stderr)")
        #expect(failed.first?.contains("fix the PIN source (the PIN file \(pin))") == true, "the hint names the file: \(start.stderr)")
        #expect(!start.stderr.contains("SIGHUP") && !start.stderr.contains("\"pin_rejected\""), "no advice to reload a daemon that exits: \(start.stderr)")

        let list = runSignctl(["--config", daemon.configPath, "keys", "list"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(list.status == 77, "\(list.stderr)")
        // SoftHSM itself now reports the refused login (CKF_USER_PIN_COUNT_LOW):
        // signctl warns before it sends the PIN, and prints nothing else of the log.
        // in its own words ("warning: pin_count_low: …" and a hint), no JSON log line.
        let lines = list.stderr.split(separator: "\n")
        #expect(lines.first?.hasPrefix("warning: pin_count_low: ") == true && lines.dropFirst().first?.hasPrefix("hint: ") == true, "\(list.stderr)")
        #expect(!list.stderr.contains("{\""), "no daemon log line: \(list.stderr)")
        let own = lines.dropFirst(2).joined(separator: "\n")
        #expect(own.hasPrefix("error: "), "signctl's own error next: \(list.stderr)")
        #expect(!list.stderr.contains("SIGHUP"), "\(list.stderr)")
        // Which PIN was refused: the file it came from, never the PIN.
        #expect(own.hasPrefix("error: pin_rejected: ") && own.contains("(the PIN read from the PIN file \(pin) that token_uri of \(daemon.configPath) names)"), "\(list.stderr)")
        #expect(!list.stderr.contains(String(repeating: "9", count: 8)), "no PIN in the output: \(list.stderr)")
        // Another SoftHSM token with the same label may have got it: where SoftHSM looked.
        #expect(own.contains("SoftHSM looked in ") && own.contains("SOFTHSM2_CONF is "), "\(list.stderr)")
    }
}

/// A reload that added a key not on the token logged only `config_reloaded`;
/// at start the same key is named by `key_unusable`.
@Suite("a reload tests its keys as the start does")
struct ReloadKeyCheckTests {
    @Test("a key added by a reload but missing from the token is logged as key_unusable; the keys on the token still sign")
    func missingKeyNamed() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        var config = daemon.config
        config["keys"] = [["key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"]], ["key_id": "MISSING001", "bundle_ids": ["com.example.missing"]]]
        try daemon.writeConfig(config)
        #expect(daemon.reload())
        let unusable = daemon.logged { $0.contains("\"key_unusable\"") && $0.contains("\"key.id\":\"MISSING001\"") }
        #expect(unusable.count == 1 && unusable[0].contains("signctl keys import"), "\(unusable)")
        #expect(daemon.logged(within: 0.5) { $0.contains("\"key_unusable\"") && $0.contains("ABC123DEFG") }.isEmpty, "the key on the token passed")
        let publicKey = try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM
        #expect(try signAndVerify(daemon.client(), keyID: "ABC123DEFG", publicKeyPEM: publicKey))
    }

    /// A reload while the token was down (its directory away) logged
    /// key_unusable with "import it with signctl keys import" for every
    /// configured key, reload after reload: keys that were fine, and advice
    /// that cannot help during an outage.
    @Test("a reload while the token is down names no key unusable; it says once that the test waits for the token")
    func reloadDuringOutage() throws {
        let daemon = try DaemonHarness(keyIDs: ["KEY0000001", "KEY0000002", "KEY0000003"])
        try daemon.start()
        defer { daemon.stop() }
        let tokens = daemon.directory + "/hsm/tokens"
        try FileManager.default.moveItem(atPath: tokens, toPath: tokens + ".away")
        defer { try? FileManager.default.moveItem(atPath: tokens + ".away", toPath: tokens) }
        let body = body(["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"])
        #expect(poll(seconds: 5) { (try? daemon.client().send("POST", "/v1/sign/promotional-offer", body: body).status) == 503 }, "the outage is seen")
        #expect(daemon.reload())
        let skipped = daemon.logged { $0.contains("\"self_test_skipped\"") }
        #expect(skipped.count == 1, "\(daemon.log.suffix(6))")
        #expect(daemon.logged(within: 0.5) { $0.contains("\"key_unusable\"") }.isEmpty, "\(daemon.log.suffix(6))")
    }

    /// The reload's self-test ran on a thread nobody waited for: SIGTERM
    /// closed the token (C_Finalize) under its C_Sign, and signerd died of
    /// SIGSEGV or SIGABRT instead of exiting 0, or logged the keys it was
    /// still testing as key_unusable after shutdown_requested.
    @Test("SIGTERM right after SIGHUP: exit 0, and no key is called unusable while the token closes")
    func stopDuringReloadSelfTest() throws {
        let daemon = try DaemonHarness(keyIDs: (1...16).map { String(format: "KEY%07d", $0) })
        for round in 1...8 {
            try daemon.start()
            daemon.send(SIGHUP)
            usleep(UInt32(round % 4) * 5_000)
            let status = daemon.stop()
            #expect(status == 0, "round \(round): \(daemon.log.suffix(5).joined(separator: "\n"))")
            #expect(daemon.log.filter { $0.contains("\"key_unusable\"") }.isEmpty, "round \(round)")
        }
    }
}

/// A `socket_group` the daemon's user is not in made signerd exit 69 when it
/// bound the socket itself (chown to a group needs membership), and
/// `--check-config` said nothing.
@Suite("socket_group and the daemon's user")
struct SocketGroupMembershipTests {
    static let canSwitchUser = getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv")

    @Test("--check-config warns when this user is not a member of socket_group, and not when it is",
          .enabled(if: canSwitchUser, "needs root and setpriv(1) to run signerd --check-config as uid 65534"))
    func checkConfigWarns() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let pin = try CheckConfigTests().pinPath(daemon)
        let ownPIN = daemon.directory + "/nobody.pin"
        try writeSecretFile(ownPIN, try String(contentsOfFile: pin, encoding: .utf8))
        chown(ownPIN, 65534, 65534)
        func check(group: String) throws -> (status: Int32, stdout: String, stderr: String) {
            try daemon.writeConfig(["token_uri": daemon.tokenURI.replacingOccurrences(of: pin, with: ownPIN), "socket_group": group])
            chmod(daemon.configPath, 0o644)  // whatever umask another test set meanwhile: uid 65534 reads it
            return runProgram("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", "--", Binaries.signerd, "--config", daemon.configPath, "--check-config"])
        }
        let foreign = try check(group: "0")
        #expect(foreign.status == 0, "\(foreign.stderr)")
        #expect(foreign.stdout.contains("warning: socket_group_not_joined: this user (uid 65534) is not a member of socket_group 0"), "\(foreign.stdout)")
        let own = try check(group: "65534")
        #expect(own.status == 0, "\(own.stderr)")
        #expect(!own.stdout.contains("socket_group_not_joined"), "\(own.stdout)")
    }

    /// An attack round read the PIN as a backend: the PIN file was
    /// root:clients 0640, and the clients' group was the socket's.
    @Test("a PIN file readable by a group of the callers (socket_group, allowed_gids) is warned of at --check-config and at start; one of another group is not",
          .enabled(if: geteuid() == 0, "giving the PIN file to another group needs root"))
    func pinFileReadableByCallers() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        let pin = try CheckConfigTests().pinPath(daemon)
        #expect(chown(pin, 0, 65534) == 0 && chmod(pin, 0o640) == 0)
        for (settings, warned) in [(["socket_group": "65534"], true), (["allowed_gids": [65534]], true), (["socket_group": "0"], false)] as [([String: Any], Bool)] {
            try daemon.writeConfig(settings)
            let checked = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"])
            #expect(checked.status == 0, "\(settings): \(checked.stderr)")
            #expect(checked.stdout.contains("warning: pin_file_readable_by_callers: the PIN file \(pin) may be read by its group, gid 65534") == warned, "\(settings): \(checked.stdout)")
        }
        try daemon.writeConfig(["allowed_gids": [65534]])
        try daemon.start()
        defer { daemon.stop() }
        #expect(!daemon.logged { $0.contains("\"pin_file_readable_by_callers\"") }.isEmpty, "logged at start")
    }

    /// `socket_mode "0640"` with a `socket_group` passed --check-config in
    /// silence, and every member of the group was then refused (EACCES).
    @Test("--check-config warns when socket_mode gives socket_group no write bit (connecting needs it), and not for 0660")
    func groupWithoutWriteWarned() throws {
        let daemon = try DaemonHarness(keyIDs: [])
        for (mode, warned) in [("0640", true), ("0600", true), ("0660", false)] {
            try daemon.writeConfig(["socket_group": "0", "socket_mode": mode])
            let checked = runProgram(Binaries.signerd, ["--config", daemon.configPath, "--check-config"])
            #expect(checked.status == 0, "\(mode): \(checked.stderr)")
            #expect(checked.stdout.contains("warning: socket_group_cannot_connect: socket_mode \(mode.dropFirst()) gives socket_group 0 no write permission") == warned, "\(mode): \(checked.stdout)")
        }
    }
}

/// `--config` naming a directory or a FIFO: signerd and signctl said
/// "NSCocoaErrorDomain error 256" or "You don't have permission".
@Suite("a configuration path that is not a regular file")
struct ConfigurationNotAFileTests {
    @Test("signerd --check-config, signerd and signctl exit 78 saying what the path is")
    func notAFile() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-confkind")
        let fifo = directory + "/fifo.json"
        #expect(makeFIFO(fifo))
        for (path, says) in [(directory, "\(directory) is a directory, not a file"), (fifo, "\(fifo) is not a regular file (it is a FIFO (named pipe))")] {
            let checked = runProgram(Binaries.signerd, ["--config", path, "--check-config"])
            #expect(checked.status == 78, "\(checked.stderr)")
            #expect(checked.stderr.hasPrefix("error: config_invalid: the configuration file \(says)"), "\(checked.stderr)")
            let started = runProgram(Binaries.signerd, ["--config", path])
            #expect(started.status == 78, "\(started.stderr)")
            #expect(started.stderr.contains("\"config_invalid\"") && started.stderr.contains(says), "\(started.stderr)")
            let listed = runSignctl(["--config", path, "keys", "list"])
            #expect(listed.status == 78, "\(listed.stderr)")
            #expect(listed.stderr.hasPrefix("error: the configuration file \(says)"), "\(listed.stderr)")
        }
    }
}

@Suite("signerd under a file size limit")
struct FileSizeLimitStartTests {
    /// signerd's first C_Login rewrote SoftHSM's token file under the
    /// limit, cut it short, and went on signing from memory with the token
    /// on disk already gone.
    @Test("a hard file size limit smaller than the token file: signerd exits 78 with file_size_limit before it logs in, and the token survives")
    func refusesToStart() throws {
        let daemon = try DaemonHarness()
        // timeout(1): without the check signerd would start and keep running.
        let run = runProgram("/usr/bin/timeout", ["20", "/usr/bin/prlimit", "--fsize=100", Binaries.signerd, "--config", daemon.configPath],
                             environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(run.status == 78, "\(run.stdout) \(run.stderr)")
        #expect((run.stdout + run.stderr).contains("\"file_size_limit\""), "\(run.stdout) \(run.stderr)")
        // --check-config said "valid" under the same limit (an operator audit): ExecStartPre= would not catch it.
        let check = runProgram("/usr/bin/prlimit", ["--fsize=100", Binaries.signerd, "--config", daemon.configPath, "--check-config"],
                               environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(check.status == 78 && check.stderr.contains("file_size_limit: the file size limit (ulimit -f, LimitFSIZE=) is 100 bytes"), "\(check.stdout) \(check.stderr)")
        let roomy = runProgram("/usr/bin/prlimit", ["--fsize=1048576", Binaries.signerd, "--config", daemon.configPath, "--check-config"],
                               environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(roomy.status == 0 && roomy.stdout.contains("warning: file_size_limit: "), "\(roomy.stdout) \(roomy.stderr)")
        try daemon.start()
        defer { daemon.stop() }
        #expect(try daemon.client().send("GET", "/readyz").status == 200, "the token survived")
    }
}


/// An attack round held idle connections under a hard open-file limit of
/// 1024: at about 510 the descriptors ran out, SoftHSM could not open its
/// token files, the token went down for every caller, libmicrohttpd's
/// listening thread spun, and root's reserve could not even connect.
@Suite("signerd under a low open-file limit")
struct OpenFileLimitTests {
    @Test("a hard open-file limit too low for max_connections: max_connections is lowered to fit and said so; connections past it are refused and the token keeps its descriptors")
    func connectionsFitTheLimit() throws {
        let daemon = try DaemonHarness()
        let limit = ["/usr/bin/prlimit", "--nofile=200:200", "--"]
        // (200 − 64 kept for the module and the rest) / 2 per connection − 9 kept for root and signerd's own check.
        let check = runProgram(limit[0], Array(limit.dropFirst()) + [Binaries.signerd, "--config", daemon.configPath, "--check-config"],
                               environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(check.status == 0, "\(check.stdout) \(check.stderr)")
        #expect(check.stdout.contains("warning: open_file_limit_low: the open-file limit is 200 descriptors, and max_connections 1024 needs 2130")
                && check.stdout.contains("max_connections is lowered to 59"), "\(check.stdout)")
        try daemon.start(launcher: limit)
        defer { daemon.stop() }
        let warned = daemon.logged { $0.contains("\"open_file_limit_low\"") }
        #expect(warned.count == 1 && warned.first?.contains("\"max_connections\":59") == true, "\(daemon.log.suffix(5))")
        // Without the lower limit about 95 connections would take every descriptor.
        var held: [UnixConnection] = []
        defer { held.forEach { $0.close() } }
        for _ in 0..<150 {
            guard let connection = try? UnixConnection.connect(path: daemon.socketPath, timeout: 2) else { break }
            held.append(connection)
        }
        usleep(500_000)
        // The first connection was admitted: it signs, with the token's files still openable.
        let json = body(["bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"])
        try held[0].write(Array("POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(json.count)\r\n\r\n".utf8) + json)
        let (head, answer) = try held[0].readResponse()
        #expect(daemon.verifies(rawResponse: head + "\r\n\r\n" + answer), "\(head) \(answer)")
        #expect(daemon.logged { $0.contains("\"token_down\"") }.isEmpty, "\(daemon.log.suffix(5))")
        #expect(!daemon.logged { $0.contains("\"connection_refused\"") }.isEmpty, "connections past max_connections and the reserve were refused")
        held.forEach { $0.close() }
        held.removeAll()
        #expect(poll(seconds: 5) { (try? daemon.client().send("GET", "/readyz"))?.status == 200 })
    }

    @Test("a hard open-file limit that fits no connection: signerd and --check-config exit 78 with open_file_limit_too_low, before the token is opened")
    func noConnectionFits() throws {
        let daemon = try DaemonHarness()
        let run = runProgram("/usr/bin/timeout", ["20", "/usr/bin/prlimit", "--nofile=80:80", "--", Binaries.signerd, "--config", daemon.configPath],
                             environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(run.status == 78, "\(run.stdout) \(run.stderr)")
        #expect(run.stderr.contains("\"open_file_limit_too_low\"") && run.stderr.contains("no connection fits"), "\(run.stderr)")
        #expect(!run.stderr.contains("\"token_opened\""), "\(run.stderr)")
        // ExecStartPre's check says the same, so systemd does not start a daemon certain to fail.
        let check = runProgram("/usr/bin/prlimit", ["--nofile=80:80", "--", Binaries.signerd, "--config", daemon.configPath, "--check-config"],
                               environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(check.status == 78 && check.stderr.contains("open_file_limit_too_low: ") && check.stderr.contains("no connection fits"), "\(check.stdout) \(check.stderr)")
    }
}

/// SoftHSM reads its token files at `C_Initialize` and rewrites them at
/// `C_Login`. Three signerd started at once on one token failed 2 starts in
/// 27 with `token_not_found` ("1 uninitialized token") or `C_Login`
/// returning `CKR_USER_PIN_NOT_INITIALIZED`: each read the files while
/// another rewrote them. signerd now takes signctl's lock on the token
/// directory from before `C_Initialize` to the keys' self-test. Once
/// running, its token recovery takes it too (a short wait): a recovery's
/// `C_Login` beside `signctl keys import` made the import report the token
/// gone, 3 times in 1,942 imports.
@Suite("signerd's start, its recovery and the SoftHSM token lock", .serialized)
struct StartTokenLockTests {
    @Test("a running signerd's recovery waits for another process's lock before its C_Initialize and C_Login, and recovers once it is free")
    func recoveryWaitsForTheLock() throws {
        let daemon = try checkingDaemon()
        defer { _ = daemon.stop() }
        // Opened before the directory goes, so it is the same file when the directory is back.
        let lock = try HeldLock(daemon)
        try outage(daemon) {
            // While the directory is away there is no lock file to take, and nothing is logged about it.
            usleep(500_000)
            #expect(!daemon.log.contains { $0.contains("\"token_lock_unusable\"") }, "\(daemon.log.suffix(5))")
        }
        let waited = daemon.logged(within: 10) { $0.contains("\"token_lock_wait\"") && $0.contains("\"during\":\"recovery\"") }
        try #require(waited.count == 1, "recovery did not wait for the lock: \(daemon.log.suffix(8))")
        #expect(waited.first?.contains("PID \(getpid()) (") == true, "\(waited)")
        // Held for less than recovery's 2-s wait: no login until it is released.
        usleep(800_000)
        #expect(!daemon.log.contains { $0.contains("\"token_up\"") }, "recovered while another process held the lock: \(daemon.log.suffix(5))")
        lock.release()
        #expect(!daemon.logged(within: 10) { $0.contains("\"token_up\"") }.isEmpty, "\(daemon.log.suffix(5))")
        #expect(!daemon.log.contains { $0.contains("\"token_lock_timeout\"") }, "\(daemon.log.suffix(5))")
        let request = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        #expect(daemon.verifies(try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(request.utf8))))
    }

    @Test("a start waits while another process holds the lock, logs who holds it, and serves once it is free")
    func waitsForTheLock() throws {
        let daemon = try DaemonHarness()
        let lock = try HeldLock(daemon)
        let held = Mutex<(servedWhileHeld: Bool, released: Bool)>((false, false))
        let socketPath = daemon.socketPath
        let releaser = Thread {
            // The lock goes 1.5 s after signerd said it waits for it.
            _ = poll(seconds: 10) { daemon.log.contains { $0.contains("\"token_lock_wait\"") } }
            usleep(1_500_000)
            let answered = (try? SignerClient(socketPath: socketPath, timeout: 1).send("GET", "/healthz"))?.status == 200
            held.withLock { $0 = (answered, true) }
            lock.release()
        }
        releaser.start()
        try daemon.start()
        defer { _ = daemon.stop() }
        let waited = daemon.logged { $0.contains("\"token_lock_wait\"") }
        #expect(waited.count == 1 && waited.first?.contains("PID \(getpid()) (") == true, "\(daemon.log.joined(separator: "\n"))")
        let (servedWhileHeld, released) = held.withLock { $0 }
        #expect(released, "signerd served before the lock was released")
        #expect(!servedWhileHeld, "signerd answered /healthz while another process held the lock")
        let request = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        #expect(daemon.verifies(try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(request.utf8))))
        // Released after the start: a signctl command on the token does not wait for the running daemon.
        let listed = runSignctl(["--config", daemon.configPath, "keys", "list"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(listed.status == 0 && !listed.stderr.contains("waiting: another process"), "\(listed.stderr)")
    }

    @Test("a reload's login after a refused PIN waits for another process's lock too, then logs in (token_up, pin_reloaded)")
    func reloadLoginWaitsForTheLock() throws {
        let daemon = try checkingDaemon()
        defer { _ = daemon.stop() }
        let pinFile = try CheckConfigTests().pinPath(daemon)
        let rightPIN = try String(contentsOfFile: pinFile, encoding: .utf8)
        // A wrong PIN, first sent at the login after an outage; the token refuses it.
        try writeSecretFile(pinFile, "not-the-pin-0000\n")
        daemon.send(SIGHUP)
        try #require(!daemon.logged { $0.contains("\"pin_changed\"") }.isEmpty, "\(daemon.log.suffix(5))")
        try outage(daemon) {}
        try #require(!daemon.logged(within: 15) { $0.contains("\"pin_rejected\"") }.isEmpty, "\(daemon.log.suffix(5))")
        let lock = try HeldLock(daemon)
        try writeSecretFile(pinFile, rightPIN)
        daemon.send(SIGHUP)
        let waited = daemon.logged(within: 10) { $0.contains("\"token_lock_wait\"") && $0.contains("\"during\":\"recovery\"") }
        try #require(waited.count == 1, "the reload's login did not wait for the lock: \(daemon.log.suffix(8))")
        usleep(800_000)
        let reloaded = { daemon.log.contains { $0.contains("\"token_up\"") && $0.contains("\"pin_reloaded\"") } }
        #expect(!reloaded(), "logged in while another process held the lock: \(daemon.log.suffix(5))")
        lock.release()
        #expect(poll(seconds: 10, reloaded), "\(daemon.log.suffix(5))")
        let request = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        #expect(daemon.verifies(try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(request.utf8))))
    }

    /// Moves `daemon`'s token directory away until signerd logs
    /// `token_down`, runs `whileAway`, and puts it back.
    func outage(_ daemon: DaemonHarness, whileAway: () throws -> Void) throws {
        let tokens = daemon.directory + "/hsm/tokens"
        try FileManager.default.moveItem(atPath: tokens, toPath: tokens + ".away")
        defer { try? FileManager.default.moveItem(atPath: tokens + ".away", toPath: tokens) }
        try #require(!daemon.logged(within: 10) { $0.contains("\"token_down\"") }.isEmpty, "\(daemon.log.suffix(5))")
        try whileAway()
    }

    /// A signerd process of its own, its stderr in a file.
    final class RawDaemon {
        let process = Process()
        let logPath: String

        init(_ daemon: DaemonHarness, config: String? = nil, name: String) throws {
            logPath = daemon.directory + "/\(name).log"
            _ = FileManager.default.createFile(atPath: logPath, contents: nil)
            process.executableURL = URL(fileURLWithPath: Binaries.signerd)
            process.arguments = ["--config", config ?? daemon.configPath]
            process.environment = daemon.environment
            process.standardError = FileHandle(forWritingAtPath: logPath)
            try process.run()
        }

        var log: String { (try? String(contentsOfFile: logPath, encoding: .utf8)) ?? "" }

        func logged(_ message: String, within seconds: Double = 10) -> Bool {
            poll(seconds: seconds) { self.log.contains("\"\(message)\"") }
        }

        deinit {
            if process.isRunning { process.terminate() }
            process.waitUntilExit()
        }
    }

    /// Holds signctl's lock on `daemon`'s token directory until `release()`
    /// (once; again does nothing) or until it is released itself.
    final class HeldLock: Sendable {
        private let descriptor: Mutex<Int32>
        init(_ daemon: DaemonHarness) throws {
            let opened = open(StartTokenLockTests.lockPath(daemon), O_RDWR | O_CREAT | O_CLOEXEC, 0o660)
            try #require(opened >= 0)
            try #require(flock(opened, LOCK_EX) == 0)
            descriptor = Mutex(opened)
        }
        func release() {
            descriptor.withLock { held in
                if held >= 0 { close(held) }
                held = -1
            }
        }
        deinit { release() }
    }

    /// A started signerd that checks its idle token every second, so that an outage is found without a request.
    func checkingDaemon() throws -> DaemonHarness {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["token_check_seconds": 1])
        try daemon.start()
        return daemon
    }

    /// signctl's lock file in `daemon`'s SoftHSM token directory.
    static func lockPath(_ daemon: DaemonHarness) -> String {
        daemon.directory + "/hsm/tokens/" + SoftHSMFiles.lockFileName
    }

    /// Starts a signerd and requires that it logs it waits for the lock.
    func startWaiting(_ daemon: DaemonHarness, name: String) throws -> RawDaemon {
        let started = try RawDaemon(daemon, name: name)
        try #require(started.logged("token_lock_wait"), "\(started.log)")
        return started
    }

    func serves(_ socketPath: String) -> Bool {
        (try? SignerClient(socketPath: socketPath, timeout: 1).send("GET", "/healthz"))?.status == 200
    }

    @Test("SIGTERM or SIGINT while the start waits for the lock ends it at once (exit 0), before the token is opened", arguments: [SIGTERM, SIGINT])
    func stoppedWhileWaiting(_ signal: Int32) throws {
        let daemon = try DaemonHarness()
        let lock = try HeldLock(daemon)
        defer { lock.release() }
        let waiting = try startWaiting(daemon, name: "waiting")
        let sent = Date()
        kill(waiting.process.processIdentifier, signal)
        try #require(poll(seconds: 5) { !waiting.process.isRunning }, "still waiting 5 s after the signal: \(waiting.log)")
        // Before, the signal waited out the 30-s wait, then the unlocked C_Login, READY=1 and the stop.
        #expect(Date().timeIntervalSince(sent) < 5)
        #expect(waiting.process.terminationStatus == 0, "\(waiting.log)")
        #expect(waiting.log.contains("\"shutdown_requested\"") && waiting.log.contains("\"signal\":\(signal)") && waiting.log.contains("\"signerd_stopped\""), "\(waiting.log)")
        #expect(!waiting.log.contains("\"token_opened\"") && !waiting.log.contains("\"token_lock_timeout\""), "\(waiting.log)")
    }

    @Test("two signerd on one socket_path that waited for the lock: the second finds the first listening and is refused (69) before its C_Login")
    func secondOnTheSameSocket() throws {
        let daemon = try DaemonHarness()
        let lock = try HeldLock(daemon)
        let first = try startWaiting(daemon, name: "first")
        let second = try startWaiting(daemon, name: "second")
        lock.release()
        try #require(poll(seconds: 20) { !first.process.isRunning || !second.process.isRunning }, "both still running: first: \(first.log)\nsecond: \(second.log)")
        let (served, refused) = first.process.isRunning ? (first, second) : (second, first)
        #expect(refused.process.terminationStatus == 69, "\(refused.log)")
        #expect(refused.log.contains("\"socket_bind_failed\"") && refused.log.contains("another process is listening on \(daemon.socketPath)"), "\(refused.log)")
        // Before, the one that got the lock second logged in, then found the socket taken.
        #expect(!refused.log.contains("\"token_opened\""), "it logged in to the token first: \(refused.log)")
        #expect(poll(seconds: 10) { serves(daemon.socketPath) } && served.process.isRunning, "\(served.log)")
        #expect(served.log.contains("\"token_opened\""), "token_opened is not logged at this log_level, so its absence above shows nothing: \(served.log)")
    }

    enum OddLockFile: String, CaseIterable, CustomTestStringConvertible {
        case hardLink, socket, directory
        var testDescription: String { rawValue }
    }

    @Test("a hard link, a socket or a directory at the lock's path: not used, not changed, warned of by name; signerd starts",
          arguments: OddLockFile.allCases)
    func oddLockFile(_ kind: OddLockFile) throws {
        let daemon = try DaemonHarness()
        let lockPath = Self.lockPath(daemon)
        unlink(lockPath)
        let linked = daemon.directory + "/someone-elses-file"
        var listener: Int32 = -1
        defer { if listener >= 0 { close(listener) } }
        switch kind {
        case .hardLink:
            try "not a lock\n".write(toFile: linked, atomically: false, encoding: .utf8)
            chmod(linked, 0o640)
            try #require(link(linked, lockPath) == 0)
        case .socket:
            listener = try UnixListener.bind(path: lockPath, mode: 0o600, group: nil)
        case .directory:
            try #require(mkdir(lockPath, 0o700) == 0)
        }
        try daemon.start()
        defer { _ = daemon.stop() }
        let expected = switch kind {
        case .hardLink: "has 2 hard links: it is another file linked there, whose owner and mode are left alone"
        case .socket: "is a socket"
        case .directory: "is a directory, which SoftHSM takes for a token and writes into (remove it with rm -r)"
        }
        let warned = daemon.logged { $0.contains("\"token_lock_unusable\"") }
        #expect(warned.count == 1 && warned.first?.contains(expected) == true, "\(daemon.log.joined(separator: "\n"))")
        if kind == .hardLink {
            var info = stat()
            #expect(stat(linked, &info) == 0 && info.st_mode & 0o7777 == 0o640, "the linked file's mode was changed to \(String(info.st_mode & 0o7777, radix: 8))")
            #expect((try? String(contentsOfFile: linked, encoding: .utf8)) == "not a lock\n")
        }
    }

    @Test("of two directories.tokendir lines SoftHSM reads the last, and so does the lock: the start waits for it")
    func lastTokenDirectoryLine() throws {
        let daemon = try DaemonHarness()
        let conf = try String(contentsOfFile: daemon.softHSMConf, encoding: .utf8)
        try ("directories.tokendir = \(daemon.directory)/no-tokens-here\n" + conf).write(toFile: daemon.softHSMConf, atomically: false, encoding: .utf8)
        let lock = try HeldLock(daemon)
        let waiting = try RawDaemon(daemon, name: "waiting")
        // Before, the first line's directory was locked (made there), and the start did not wait.
        #expect(waiting.logged("token_lock_wait"), "\(waiting.log)")
        #expect(!serves(daemon.socketPath))
        lock.release()
        #expect(poll(seconds: 20) { serves(daemon.socketPath) }, "\(waiting.log)")
    }

    @Test("a lock file removed and made again while the start waits: it waits for the new file's holder, not the old one's")
    func replacedWhileWaiting() throws {
        let daemon = try DaemonHarness()
        let old = try HeldLock(daemon)
        let waiting = try startWaiting(daemon, name: "waiting")
        unlink(Self.lockPath(daemon))
        let new = try HeldLock(daemon)
        old.release()
        // Before, signerd took the old file's lock and started while the new one was held.
        usleep(1_500_000)
        #expect(!serves(daemon.socketPath) && waiting.process.isRunning, "started while another process held the lock file at the path: \(waiting.log)")
        new.release()
        #expect(poll(seconds: 20) { serves(daemon.socketPath) }, "\(waiting.log)")
    }

    @Test("three signerd started at once on one token all come up and sign, three times over")
    func startedTogether() throws {
        let daemon = try DaemonHarness()
        let base = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: URL(fileURLWithPath: daemon.configPath))) as? [String: Any])
        var configs: [(config: String, socket: String)] = []
        for name in ["a", "b", "c"] {
            var config = base
            config["socket_path"] = daemon.directory + "/\(name).sock"
            let path = daemon.directory + "/\(name).json"
            try JSONSerialization.data(withJSONObject: config).write(to: URL(fileURLWithPath: path))
            chmod(path, 0o600)
            configs.append((path, daemon.directory + "/\(name).sock"))
        }
        for round in 1...3 {
            let logs = configs.map { $0.config + ".round\(round).log" }
            let processes = try zip(configs, logs).map { entry, log in
                _ = FileManager.default.createFile(atPath: log, contents: nil)
                let process = Process()
                process.executableURL = URL(fileURLWithPath: Binaries.signerd)
                process.arguments = ["--config", entry.config]
                process.environment = daemon.environment
                process.standardError = FileHandle(forWritingAtPath: log)
                try process.run()
                return process
            }
            defer {
                for process in processes where process.isRunning { process.terminate() }
                for process in processes { process.waitUntilExit() }
            }
            let request = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
            for (index, entry) in configs.enumerated() {
                let up = poll(seconds: 20) {
                    (try? SignerClient(socketPath: entry.socket, timeout: 2).send("GET", "/healthz"))?.status == 200 || !processes[index].isRunning
                }
                #expect(up && processes[index].isRunning, "round \(round): \(entry.config): \((try? String(contentsOfFile: logs[index], encoding: .utf8)) ?? "")")
                guard processes[index].isRunning else { continue }
                let response = try SignerClient(socketPath: entry.socket, timeout: 5).send("POST", "/v1/sign/promotional-offer", body: Array(request.utf8))
                #expect(daemon.verifies(response), "round \(round): \(String(decoding: response.body, as: UTF8.self))")
            }
        }
    }
}
