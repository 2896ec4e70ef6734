import Glibc
internal import CSignerShim

/// Checks that no user other than root and this process's can change what
/// a path leads to, as OpenSSH's `StrictModes` does for `authorized_keys`:
/// a directory on the way that another user owns, or may write without the
/// sticky bit, lets that user rename or replace what lies below it.
public enum PathSafety {
    /// The first directory another user could change on the way to
    /// `path`, described, or nil when there is none. The path is resolved
    /// here one component at a time, as the kernel does, and every
    /// directory entered is checked: those above the path as written, and
    /// wherever a symbolic link on the way (the last component included)
    /// leads, so a link kept in another user's directory is caught where
    /// it lies. A directory is safe when it belongs to root or to this
    /// process's uid and has the sticky bit (which keeps others from
    /// renaming or removing what they do not own, as in /tmp), or when
    /// others may not write it and its group may only if that group is this
    /// process's and has no other member (none listed, no other user with
    /// it as primary group), with no access control list (whose mask the
    /// group bits then are).
    /// - Parameter path: an absolute path.
    /// - Returns: "the directory D (owner uid U, group gid G, mode M) …",
    ///   saying who may change it; or that a directory on the way is
    ///   missing (one made after the check is not checked), is not a
    ///   directory, or that the path has more than 40 symbolic links on the
    ///   way (a loop); nil when every directory is safe, the last component
    ///   does not exist, or `path` is not absolute. Not thread-safe: the
    ///   group check enumerates the user database (``groupHasNoOtherMembers(_:)``).
    public static func unsafeDirectory(above path: String) -> String? {
        guard path.hasPrefix("/") else { return nil }
        var root = stat()
        guard lstat("/", &root) == 0 else { return "the directory / cannot be checked (\(String(cString: strerror(errno))))" }
        if let problem = problem(directory: "/", root) { return problem }
        var pending = ArraySlice(path.split(separator: "/").map(String.init))
        var current = "/"
        var links = 0
        while let component = pending.popFirst() {
            if component == "." { continue }
            if component == ".." {
                // `current` is already resolved, so its parent is the real one.
                current = current == "/" ? "/" : String(current[..<(current.lastIndex(of: "/") ?? current.startIndex)])
                if current.isEmpty { current = "/" }
                continue
            }
            let next = current == "/" ? "/" + component : current + "/" + component
            var info = stat()
            guard lstat(next, &info) == 0 else {
                // The last component may be missing (the caller opens or makes it); a directory on the way may not.
                if pending.isEmpty { return nil }
                return "the directory \(next) cannot be checked (\(String(cString: strerror(errno))))"
            }
            if (info.st_mode & S_IFMT) == S_IFLNK {
                links += 1
                guard links <= 40 else { return "the path \(path) cannot be checked (more than 40 symbolic links on the way, a loop)" }
                var buffer = [CChar](repeating: 0, count: Int(PATH_MAX) + 1)
                let count = readlink(next, &buffer, buffer.count - 1)
                guard count > 0 && count < buffer.count - 1 else {
                    return "the symbolic link \(next) cannot be read (\(String(cString: strerror(errno))))"
                }
                let target = String(decoding: buffer[..<count].map { UInt8(bitPattern: $0) }, as: UTF8.self)
                // The link lies in `current`, checked already; what it names is walked next.
                if target.hasPrefix("/") { current = "/" }
                pending = ArraySlice(target.split(separator: "/").map(String.init)) + pending
                continue
            }
            if pending.isEmpty { return nil }  // the file itself: its owner and mode are the caller's to check
            guard (info.st_mode & S_IFMT) == S_IFDIR else {
                return "the directory \(next) cannot be checked (it is not a directory)"
            }
            if let problem = problem(directory: next, info) { return problem }
            current = next
        }
        return nil
    }

    /// Why another user could change entries of `directory`, or nil.
    /// - Parameters:
    ///   - directory: the directory's path (for the message and its ACL).
    ///   - info: its `lstat(2)`, taken by the walk that reached it.
    static func problem(directory: String, _ info: stat) -> String? {
        let mode = info.st_mode & 0o7777
        let described = "the directory \(directory) (owner uid \(info.st_uid), group gid \(info.st_gid), mode \(String(mode, radix: 8)))"
        if info.st_uid != 0 && info.st_uid != geteuid() {
            return "\(described) belongs to another user, who could rename or replace what lies below it"
        }
        guard mode & mode_t(S_ISVTX) == 0 else { return nil }  // others cannot rename what they do not own
        if mode & mode_t(S_IWOTH) != 0 {
            return "\(described) may be written by other users without the sticky bit, so they could rename or replace what lies below it"
        }
        if mode & mode_t(S_IWGRP) != 0 {
            // With a POSIX ACL the group bits are its mask: a named user or
            // group may write, whatever the owning group is.
            if CSignerShim_has_access_acl(directory) != 0 {
                return "\(described) has an access control list that lets users or groups besides its owner write it (the group bits are its mask), so they could rename or replace what lies below it"
            }
            if info.st_gid != getegid() {
                return "\(described) may be written by its group, which is not this process's group (gid \(getegid())), so its members could rename or replace what lies below it"
            }
            if !groupHasNoOtherMembers(info.st_gid) {
                return "\(described) may be written by its group, which has other members than this user (listed in the group, or by primary group), so they could rename or replace what lies below it"
            }
        }
        return nil
    }

    /// ``unsafeDirectory(above:)`` for a path that may be relative (made
    /// absolute against the working directory first): every directory above
    /// it as written and wherever its symbolic links lead.
    /// - Parameter path: a file path, absolute or relative.
    /// - Returns: a sentence naming the directory, its owner and mode.
    public static func unsafeDirectory(aboveWrittenOrResolved path: String) -> String? {
        guard !path.hasPrefix("/") else { return unsafeDirectory(above: path) }
        guard let cwd = getcwd(nil, 0) else {
            return "the working directory cannot be checked (\(String(cString: strerror(errno))))"
        }
        defer { free(cwd) }
        return unsafeDirectory(above: String(cString: cwd) + "/" + path)
    }

    /// Whether group `gid` has no member but this process's user: no user
    /// listed in it in the group database (`getgrgid(3)`) and no other user
    /// whose primary group it is in the user database (`getpwent_r(3)`)
    /// (a user private group, or root's group with no one added to it).
    /// False when the user database cannot be read to its end. Members the
    /// databases do not list are not seen: users of a directory service
    /// that does not enumerate (SSSD's default), or processes given the
    /// group by other means (another unit's `Group=`, a setgid program).
    /// Not thread-safe (`getgrgid`, `getpwuid`, and the process-wide
    /// `setpwent` cursor); signerd calls it at start and on reload.
    static func groupHasNoOtherMembers(_ gid: gid_t) -> Bool {
        let own = getpwuid(geteuid()).map { String(cString: $0.pointee.pw_name) }
        if let group = getgrgid(gid), var member = group.pointee.gr_mem {
            while let name = member.pointee {
                if String(cString: name) != own { return false }
                member += 1
            }
        }
        guard let users = primaryGroupUsers(gid) else { return false }
        return !users.contains { $0 != geteuid() }
    }

    /// The uids of every user whose primary group is `gid`, from the user
    /// database (`setpwent(3)`, `getpwent_r(3)`; `/etc/passwd` and whatever
    /// else NSS enumerates), or nil when it could not be read to its end.
    /// Not thread-safe: the enumeration cursor is process-wide.
    static func primaryGroupUsers(_ gid: gid_t) -> [uid_t]? {
        var uids: [uid_t] = []
        var entry = passwd()
        var buffer = [CChar](repeating: 0, count: 4096)
        var result: UnsafeMutablePointer<passwd>?
        setpwent()
        defer { endpwent() }
        while true {
            let status = getpwent_r(&entry, &buffer, buffer.count, &result)
            if status == ERANGE && buffer.count < 1 << 20 {
                buffer = [CChar](repeating: 0, count: buffer.count * 2)
                continue
            }
            if status == ENOENT || (status == 0 && result == nil) { return uids }  // the end of the database
            guard status == 0 else { return nil }
            // `entry` holds the record (result points to it).
            if entry.pw_gid == gid { uids.append(entry.pw_uid) }
        }
    }
}
