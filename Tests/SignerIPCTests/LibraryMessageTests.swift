import Foundation
import Testing
import TestSupport
@testable import SignerIPC

/// libmicrohttpd's own messages, logged as `http_library`.
@Suite("libmicrohttpd's messages in signerd's log")
struct LibraryMessageTests {
    /// After a clean SIGTERM with an idle keep-alive connection open, an
    /// operator audit saw libmicrohttpd's "Connection socket is closed when
    /// reading request …" as a warning: `MHD_stop_daemon` closing a
    /// connection it was reading races with its own read. Which message
    /// comes when is libmicrohttpd's timing, so the test hands the server
    /// the message before and after its stop.
    @Test("a connection's closure is a warning while serving and debug once stop() closes the connections; other messages stay warnings; MHD_NO's own note is never logged")
    func quietAtStop() throws {
        let daemon = try InProcessDaemon(logLevel: .debug)
        let closure = "Connection socket is closed when reading request due to the error: detected connection closure"
        func httpLibraryLines() -> [String] { daemon.logLines.lines.filter { $0.contains("\"msg\":\"http_library\"") } }
        daemon.server.noteLibraryMessage("Application reported internal error, closing connection.")
        #expect(httpLibraryLines().isEmpty)
        daemon.server.noteLibraryMessage(closure)
        let serving = httpLibraryLines()
        #expect(serving.count == 1 && serving.first?.contains("\"level\":\"warning\"") == true && serving.first?.contains(closure) == true, "\(serving)")
        daemon.stop()
        daemon.server.noteLibraryMessage(closure)
        let afterStop = httpLibraryLines()
        #expect(afterStop.count == 2 && afterStop.last?.contains("\"level\":\"debug\"") == true && afterStop.last?.contains("\"phase\":\"stop\"") == true,
                "not a debug line once stop() closed the connections: \(afterStop)")
        // Only that message: whatever else libmicrohttpd reports during the stop is still a warning.
        daemon.server.noteLibraryMessage("Failed to join a thread")
        #expect(httpLibraryLines().count == 3 && httpLibraryLines().last?.contains("\"level\":\"warning\"") == true
                && httpLibraryLines().last?.contains("Failed to join a thread") == true, "\(httpLibraryLines())")
    }
}
