import Glibc

/// Checks that no user other than root and this process's can change what
/// a path leads to, as OpenSSH's `StrictModes` does for `authorized_keys`:
/// a directory on the way that another user owns, or may write without the
/// sticky bit, lets that user rename or replace what lies below it.
public enum PathSafety {
    /// The first directory from `/` down to the parent of `path` that
    /// another user could change, described, or nil when there is none.
    /// A directory is safe when it belongs to root or to this process's
    /// uid, and neither others nor a group other than this process's may
    /// write it, unless it has the sticky bit (which keeps them from
    /// renaming or removing what they do not own, as in /tmp). Each
    /// directory is looked up with `stat(2)`, symbolic links followed; check
    /// a resolved path (`realpath(3)`) as well to cover the directories a
    /// link leads through.
    /// - Parameter path: an absolute path.
    /// - Returns: "the directory D (owner uid U, group gid G, mode M) …",
    ///   saying who may change it; nil when every directory is safe or
    ///   `path` is not absolute.
    public static func unsafeDirectory(above path: String) -> String? {
        guard path.hasPrefix("/") else { return nil }
        let components = path.split(separator: "/", omittingEmptySubsequences: true).dropLast()
        var directory = ""
        for component in [""] + components.map(String.init) {
            directory = component.isEmpty ? "/" : (directory == "/" ? "/" : directory + "/") + component
            if let problem = problem(directory: directory) { return problem }
        }
        return nil
    }

    /// Why another user could change entries of `directory`, or nil.
    static func problem(directory: String) -> String? {
        var info = stat()
        guard stat(directory, &info) == 0 else { return nil }  // the caller's own open or bind says why
        let mode = info.st_mode & 0o7777
        let described = "the directory \(directory) (owner uid \(info.st_uid), group gid \(info.st_gid), mode \(String(mode, radix: 8)))"
        if info.st_uid != 0 && info.st_uid != geteuid() {
            return "\(described) belongs to another user, who could rename or replace what lies below it"
        }
        let sticky = mode & mode_t(S_ISVTX) != 0
        let othersWrite = mode & mode_t(S_IWOTH) != 0 || (mode & mode_t(S_IWGRP) != 0 && info.st_gid != getegid())
        if othersWrite && !sticky {
            return "\(described) may be written by other users without the sticky bit, so they could rename or replace what lies below it"
        }
        return nil
    }
}
