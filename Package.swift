// swift-tools-version:6.0
//
// signerd: keeps an App Store In-App Purchase key inside a PKCS#11 token and
// signs for other processes on the same host over a Unix socket.
import PackageDescription

let package = Package(
    name: "signerd",
    products: [
        .executable(name: "signerd", targets: ["signerd"]),
        .executable(name: "signctl", targets: ["signctl"]),
        .library(name: "HSMSigner", targets: ["HSMSigner"]),
        .library(name: "SignerIPC", targets: ["SignerIPC"]),
    ],
    targets: [
        // C surface: PKCS#11 headers, module loading and RFC 7512 URIs from p11-kit.
        .systemLibrary(
            name: "CPKCS11",
            pkgConfig: "p11-kit-1",
            providers: [.apt(["libp11-kit-dev"])]
        ),
        // C surface: libcrypto (SHA-256, PKCS#8/SEC1 parsing, ECDSA verification).
        .systemLibrary(
            name: "CLibCrypto",
            pkgConfig: "libcrypto",
            providers: [.apt(["libssl-dev"])]
        ),
        // C surface: libmicrohttpd, the HTTP/1.1 server on the Unix socket.
        .systemLibrary(
            name: "CMicroHTTPD",
            pkgConfig: "libmicrohttpd",
            providers: [.apt(["libmicrohttpd-dev"])]
        ),
        // What Swift cannot import: variadic calls, macros, struct ucred, prctl.
        .target(
            name: "CSignerShim",
            dependencies: ["CMicroHTTPD", "CLibCrypto"]
        ),
        .target(
            name: "HSMSigner",
            dependencies: ["CPKCS11", "CLibCrypto", "CSignerShim"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        .target(
            name: "SignerIPC",
            dependencies: ["HSMSigner", "CMicroHTTPD", "CSignerShim"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        .executableTarget(
            name: "signerd",
            dependencies: ["SignerIPC", "HSMSigner"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        .executableTarget(
            name: "signctl",
            dependencies: ["SignerIPC", "HSMSigner"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // The fuzz targets: libFuzzer binaries under scripts/fuzz.sh, a replayer
        // of saved inputs in an ordinary build (the tests replay Tests/FuzzCorpus).
        .executableTarget(
            name: "signerd-fuzz",
            dependencies: ["SignerIPC", "HSMSigner", "TestSupport"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // Fixtures shared by the test targets: throw-away SoftHSM tokens, key files in every form.
        .target(
            name: "TestSupport",
            dependencies: ["HSMSigner", "SignerIPC"],
            path: "Tests/TestSupport",
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        .testTarget(
            name: "HSMSignerTests",
            dependencies: ["HSMSigner", "CLibCrypto", "CSignerShim", "TestSupport"],
            resources: [.copy("Vectors")],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        .testTarget(
            name: "SignerIPCTests",
            dependencies: ["SignerIPC", "HSMSigner", "TestSupport"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
        // Starts the real signerd and signctl binaries on SoftHSM tokens.
        .testTarget(
            name: "EndToEndTests",
            dependencies: ["SignerIPC", "HSMSigner", "TestSupport"],
            exclude: ["Scripts"],
            swiftSettings: [.swiftLanguageMode(.v6)]
        ),
    ]
)
