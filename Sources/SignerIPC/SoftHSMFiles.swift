import Foundation

#if canImport(Glibc)
import Glibc
#endif

/// Where SoftHSM keeps its tokens, for the checks signctl and signerd make
/// on SoftHSM's files before they load the module: its token directory is
/// `directories.tokendir` (default /var/lib/softhsm/tokens) of the file
/// `SOFTHSM2_CONF` names, else of ~/.config/softhsm2/softhsm2.conf when it
/// exists, else of /etc/softhsm/softhsm2.conf (SoftHSM 2.6's order), with
/// one directory per token holding `token.object` and one file per object.
public enum SoftHSMFiles {
    /// SoftHSM's token directory for a module, or nil when the module is
    /// not SoftHSM (its file name says so) or the configuration does not
    /// name one.
    /// - Parameter module: `module-path` or `module-name` of the token URI.
    public static func tokenDirectory(module: String?) -> String? {
        guard let module, module.lowercased().contains("softhsm") else { return nil }
        // SoftHSM's own order: SOFTHSM2_CONF, then the user's file, then the system's.
        let environment = ProcessInfo.processInfo.environment
        let userConf = environment["HOME"].map { $0 + "/.config/softhsm2/softhsm2.conf" }
        let conf = environment["SOFTHSM2_CONF"]
            ?? userConf.flatMap { FileManager.default.fileExists(atPath: $0) ? $0 : nil }
            ?? "/etc/softhsm/softhsm2.conf"
        guard let text = try? String(contentsOfFile: conf, encoding: .utf8) else { return nil }
        guard let line = text.split(whereSeparator: \.isNewline).first(where: { $0.trimmingCharacters(in: .whitespaces).hasPrefix("directories.tokendir") }),
              let equals = line.firstIndex(of: "=") else {
            return "/var/lib/softhsm/tokens"  // SoftHSM's default
        }
        return line[line.index(after: equals)...].trimmingCharacters(in: .whitespaces)
    }

    /// The largest `token.object` under `tokenDirectory` and its size in
    /// bytes: the file SoftHSM rewrites in place at every `C_Login`.
    public static func largestTokenFile(in tokenDirectory: String) -> (path: String, bytes: UInt64)? {
        let entries = (try? FileManager.default.contentsOfDirectory(atPath: tokenDirectory)) ?? []
        var largest: (path: String, bytes: UInt64)?
        for entry in entries {
            let path = tokenDirectory + "/" + entry + "/token.object"
            var info = stat()
            guard stat(path, &info) == 0, UInt64(info.st_size) > largest?.bytes ?? 0 else { continue }
            largest = (path, UInt64(info.st_size))
        }
        return largest
    }

    /// Why logging in to SoftHSM under a file size limit of `limit` bytes
    /// would destroy a token (a `token.object` larger than the limit, cut
    /// short as it is rewritten), or nil.
    /// - Parameters:
    ///   - limit: the file size limit in force, in bytes.
    ///   - module: `module-path` or `module-name` of the token URI.
    public static func loginWouldCut(limit: UInt64, module: String?) -> String? {
        guard let directory = tokenDirectory(module: module), let file = largestTokenFile(in: directory), file.bytes > limit else { return nil }
        return "the file size limit (ulimit -f, LimitFSIZE=) is \(limit) bytes, smaller than SoftHSM's token file \(file.path) (\(file.bytes) bytes), which SoftHSM rewrites in place at every login: logging in would cut it short and destroy the token; nothing was done. Run with no file size limit"
    }
}
